"""`loraserve serve MODEL --replicas N`: N engine replicas on Ray Serve behind the one HTTP server.

This process is the ingress: it binds --host/--port, runs the same FastAPI app and uvicorn server as
the single-process launcher (so validation, errors, streaming, auth, TLS and the draining shutdown are
unchanged) with a `ReplicaClient` in place of the engine. The replicas are a Serve deployment of
`EngineReplica` with every engine flag, routed by `AffinityRouter`; Ray's own HTTP proxy is off.

A local Ray (no dashboard, a small object store) starts unless RAY_ADDRESS names a cluster to join;
on the way out the app is deleted from a joined cluster, and a local Ray is shut down.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import ray
from ray import serve
from ray.serve.config import RequestRouterConfig

from loraserve import envs
from loraserve.engine.arg_utils import EngineArgs
from loraserve.entrypoints.openai.cli.launcher import (
    bind_socket,
    log_startup,
    run_main,
    server_options,
    use_demo_model,
)
from loraserve.entrypoints.openai.server.api_server import build_app
from loraserve.entrypoints.openai.server.frontend import (
    FrontendOptions,
    bind_unix_socket,
    uvicorn_options,
)
from loraserve.entrypoints.openai.server.http_server import serve_app
from loraserve.entrypoints.ray.client import ReplicaClient
from loraserve.entrypoints.ray.deployment import EngineReplica
from loraserve.entrypoints.ray.replica_header import ReplicaHeaderMiddleware
from loraserve.entrypoints.ray.router import AffinityRouter

logger = logging.getLogger("loraserve.server")
APP_NAME = "loraserve"
DEPLOYMENT_NAME = "engine"
LOCAL_OBJECT_STORE_BYTES = 128 << 20  # only requests and outputs cross it: small objects
ROUTING_STATS_PERIOD_S = 2.0  # how often each replica reports its adapters to the router
HEALTH_CHECK_PERIOD_S = 2.0
# The engine's own queue limits answer 503 when full; Ray's per-replica cap must never bind first.
MAX_ONGOING_PER_REPLICA = 100_000
# The environment the replicas get from this process (Ray starts them with its own): loraserve's and
# vLLM's settings, Hugging Face's, and what boto3 reads for the S3 adapter store. Nothing else: the
# rest of a shell's environment is none of the replicas' business.
_FORWARDED_ENV_PREFIXES = ("LORASERVE_", "VLLM_", "HF_", "TRANSFORMERS_", "AWS_ENDPOINT_URL")
_FORWARDED_AWS_ENV = frozenset({
    "AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_SESSION_TOKEN",  # static credentials
    "AWS_PROFILE", "AWS_CONFIG_FILE", "AWS_SHARED_CREDENTIALS_FILE",  # credentials from files
    "AWS_ROLE_ARN", "AWS_WEB_IDENTITY_TOKEN_FILE", "AWS_ROLE_SESSION_NAME",  # web identity (EKS IRSA)
    "AWS_DEFAULT_REGION", "AWS_REGION", "AWS_CA_BUNDLE", "AWS_EC2_METADATA_DISABLED",
})  # fmt: skip


@dataclass(frozen=True, slots=True)
class ReplicaResources:
    num_cpus: float
    num_gpus: float


def replica_resources(args: argparse.Namespace, is_local: bool) -> ReplicaResources:
    cpus = args.replica_cpus
    if cpus is None:
        cpus = max(1.0, (os.cpu_count() or 1) // args.replicas) if is_local else 1.0
    gpus = args.replica_gpus
    if gpus is None:
        gpus = 1.0 if getattr(args, "device", None) == "cuda" else 0.0
    return ReplicaResources(cpus, gpus)


def replica_env_vars(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables of `environ` every replica is started with (the allow-list above)."""
    return {k: v for k, v in environ.items() if k.startswith(_FORWARDED_ENV_PREFIXES) or k in _FORWARDED_AWS_ENV}


def start_ray(args: argparse.Namespace) -> bool:
    """Join RAY_ADDRESS, or start a local Ray sized for the replicas; True when it is local."""
    address = os.environ.get("RAY_ADDRESS")
    level = logging.getLevelName(envs.logging_level())
    level = level if isinstance(level, int) else logging.INFO
    if address:
        ray.init(address=address, logging_level=level)
        return False
    resources = replica_resources(args, is_local=True)
    ray.init(
        address="local",
        num_cpus=max(os.cpu_count() or 1, int(resources.num_cpus * args.replicas + 0.999)),
        num_gpus=int(resources.num_gpus * args.replicas + 0.999) or None,
        include_dashboard=False,
        object_store_memory=LOCAL_OBJECT_STORE_BYTES,
        logging_level=level,
    )
    return True


def deploy_replicas(engine_args: EngineArgs, args: argparse.Namespace, is_local: bool) -> Any:
    """Start the replicas (blocks until every one has loaded the model); the deployment handle."""
    resources = replica_resources(args, is_local)
    env_vars = replica_env_vars(os.environ)
    serve.start(proxy_location="Disabled", logging_config={"enable_access_log": False})
    router: dict[str, Any] = {
        "request_router_class": AffinityRouter,
        "request_router_kwargs": {"spread_queue_depth": args.replica_spread_queue_depth},
        "request_routing_stats_period_s": ROUTING_STATS_PERIOD_S,
    }
    deployment = serve.deployment(
        name=DEPLOYMENT_NAME,
        num_replicas=args.replicas,
        max_ongoing_requests=MAX_ONGOING_PER_REPLICA,
        ray_actor_options={
            "num_cpus": resources.num_cpus,
            "num_gpus": resources.num_gpus,
            "runtime_env": {"env_vars": env_vars},
        },
        request_router_config=RequestRouterConfig(**router),
        health_check_period_s=HEALTH_CHECK_PERIOD_S,
        graceful_shutdown_timeout_s=args.shutdown_timeout,
        max_constructor_retry_count=1,  # a model that fails to load fails the same way every time
        logging_config={"enable_access_log": False},
    )(EngineReplica)
    app = deployment.bind(engine_args, envs.logging_level())
    try:
        return serve.run(app, name=APP_NAME, route_prefix=None)
    except RuntimeError as exc:  # "failed to update the deployments": the replica's reason is in the status
        raise RuntimeError(f"the replicas failed to start: {_deployment_failure() or exc}") from None


def _deployment_failure() -> str | None:
    """The last `SomeError: message` line of the deployment's status (a replica's startup traceback)."""
    try:
        message = serve.status().applications[APP_NAME].deployments[DEPLOYMENT_NAME].message
    except Exception:
        return None
    causes = [line.strip() for line in message.splitlines() if _is_error_line(line.strip())]
    return causes[-1] if causes else None


def _is_error_line(line: str) -> bool:
    name = line.split(":", 1)[0]
    return ":" in line and name.isidentifier() and name.endswith(("Error", "Exception"))


async def run_replicated_server(args: argparse.Namespace) -> None:
    from loraserve.plugins import load_general_plugins

    frontend = FrontendOptions.from_cli_args(args)
    sock = bind_unix_socket(frontend.uds) if frontend.uds else bind_socket(args.host, args.port)
    is_local = False
    try:
        load_general_plugins()  # the resolvers run here, at the ingress
        if args.model is None:
            use_demo_model(args)
        engine_args = EngineArgs.from_cli_args(args)
        if not os.environ.get("RAY_ADDRESS"):  # same filesystem as the replicas: bad flags fail here, fast
            engine_args.create_engine_config()
        is_local = start_ray(args)
        logger.info("Starting %d engine replicas on %s Ray.", args.replicas, "a local" if is_local else "the")
        handle = deploy_replicas(engine_args, args, is_local)
        client = await ReplicaClient.connect(handle)
        try:
            options = server_options(args, frontend)
            app = await build_app(client, options)
            app.add_middleware(ReplicaHeaderMiddleware)  # outermost: every response gets the header
            log_startup(app, client, args, sock)
            await serve_app(app, sock, options, client, uvicorn_options(frontend))
        finally:
            await client.shutdown()
    finally:
        sock.close()
        stop_ray(is_local)


def stop_ray(is_local: bool) -> None:
    """Remove the replicas. A local Ray goes whole (its processes, replicas included, are ours; a
    Serve shutdown first would only wait on a controller that a Ctrl-C to the process group may
    have killed already); a joined cluster keeps running without our app."""
    if not ray.is_initialized():
        return
    if not is_local:
        try:
            serve.delete(APP_NAME)
        except Exception:  # the cluster went away first: nothing of ours is left on it
            logger.warning("Could not delete the Serve app %r from the cluster.", APP_NAME, exc_info=True)
    ray.shutdown()


def serve_replicas_main(args: argparse.Namespace, prog: str) -> int:
    return run_main(run_replicated_server, args, prog)
