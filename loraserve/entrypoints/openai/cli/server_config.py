"""ServerConfig: the `serve` options that are not the engine's: where to listen, the API keys, the
adapters to register, request limits, shutdown and replicas. Declared once, as option fields; their
flags are generated (`cli_options.py`) and `ServerConfig.from_cli_args` reads them back by name.
Torch-free and Ray-free, like all flag parsing.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields

from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath
from loraserve.option_types import (
    json_object,
    non_negative_seconds,
    positive_float,
    positive_int,
    positive_seconds,
)
from loraserve.options import check_options, option

# The same number as affinity.DEFAULT_SPREAD_QUEUE_DEPTH, repeated so that parsing flags never imports
# the Ray package (a test checks they agree).
DEFAULT_SPREAD_QUEUE_DEPTH = 8
_LIMITS = "limits and shutdown"
_REPLICAS = "replicas (Ray Serve)"
_RESPONSES = "Responses API"


def lora_module(value: str) -> LoRAModulePath:
    """`name=path` or `{"name": ..., "path": ..., "base_model_name": ...}`."""
    value = value.strip()
    if value.startswith("{"):
        data = json_object(value)
        unknown = set(data) - {"name", "path", "base_model_name"}
        if unknown or not isinstance(data.get("name"), str) or not isinstance(data.get("path"), str):
            raise argparse.ArgumentTypeError(
                f"a JSON --lora-modules entry needs string 'name' and 'path' (optional 'base_model_name') "
                f"and nothing else, got {value!r}"
            )
        if not data["name"] or not data["path"]:
            raise argparse.ArgumentTypeError(f"name and path must not be empty in {value!r}")
        return LoRAModulePath(data["name"], data["path"], data.get("base_model_name"))
    name, sep, path = value.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise argparse.ArgumentTypeError(f"expected name=path or a JSON object, got {value!r}")
    return LoRAModulePath(name.strip(), path.strip())


def _a_port(port: int) -> str | None:
    return None if 0 <= port <= 65535 else f"must be in 0..65535, got {port}."


def _a_key_file(path: str | None) -> str | None:
    """The key file must read and parse now: a server that starts must know its keys."""
    if path is None:
        return None
    import yaml

    from loraserve.entrypoints.openai.server.key_store import read_key_file
    from loraserve.entrypoints.openai.serving.key_scopes import KeyFileError

    try:
        read_key_file(path)
    except OSError as exc:
        return f"cannot be read: {exc.strerror or type(exc).__name__}"
    except yaml.YAMLError:
        return "is not valid YAML or JSON"
    except KeyFileError as exc:
        return f"is not valid: {exc}"
    return None


def _distinct_names(modules: list[LoRAModulePath]) -> str | None:
    seen: set[str] = set()
    for module in modules:
        if module.name in seen:
            return f"names {module.name!r} twice."
        seen.add(module.name)
    return None


@dataclass(frozen=True, slots=True)
class ServerConfig:
    host: str = option("0.0.0.0", group="server", help="Interface to listen on (default: all interfaces).")
    port: int = option(
        8000, type=int, check=_a_port, group="server", help="TCP port to listen on (default: 8000)."
    )
    # The parser's default is $LORASERVE_API_KEY, read when the parser is made (cli_args.py).
    api_key: list[str] | None = option(
        None,
        nargs="+",
        group="server",
        help="Require 'Authorization: Bearer KEY' (any of the keys given) on every route but /health and "
        "/ping (default: $LORASERVE_API_KEY).",
    )
    api_key_file: str | None = option(
        None,
        group="server",
        check=_a_key_file,
        help="loraserve only: a YAML or JSON file of API keys, each with the adapters (names or glob "
        "patterns) it may use, whether it may use the base model, load/unload under a name prefix, and "
        "its own limits (docs/tenancy.md); re-read on SIGHUP. --api-key keys keep reaching everything.",
    )
    trust_request_chat_template: bool = option(
        False,
        action="store_true",
        group="server",
        help="Let requests bring their own chat template (chat_template, chat_template_kwargs.chat_template); "
        "off by default, since a template is code the server runs.",
    )
    lora_modules: list[LoRAModulePath] = option(
        default_factory=list,
        type=lora_module,
        nargs="+",
        action="extend",
        check=_distinct_names,
        group="LoRA",
        help="Adapters to register at startup: name=path or a JSON object "
        '{"name": ..., "path": ..., "base_model_name": ...}; several allowed.',
    )
    max_request_body_size: int = option(
        4 << 20,
        type=positive_int,
        group=_LIMITS,
        help="Largest request body in bytes, e.g. 16MiB; a larger one gets 413 (default: 4MiB: parsing a "
        "body holds the event loop, about 0.3 s per MiB of JSON in the worst case).",
    )
    request_read_timeout: float = option(
        30.0,
        type=positive_seconds,
        group=_LIMITS,
        help="Seconds within which a request's head, and then its body, must arrive; a slower "
        "connection is closed (head) or answered 408 (body) (default: %(default)s).",
    )
    shutdown_timeout: float = option(
        30.0,
        type=non_negative_seconds,
        group=_LIMITS,
        help="On SIGTERM, seconds running requests may take to finish before they end with 503 "
        "(streams: an error event, then [DONE]); 0 ends them at once (default: %(default)s).",
    )
    responses_store_max_responses: int = option(
        1024,
        type=positive_int,
        group=_RESPONSES,
        help="Responses API: how many responses created with store=true are kept for GET /v1/responses/{id} "
        "and previous_response_id; the oldest are evicted first (default: %(default)s).",
    )
    responses_store_max_bytes: int = option(
        256 << 20,
        type=positive_int,
        group=_RESPONSES,
        help="Responses API: the stored responses and the conversations they end take at most this many "
        "bytes (serialized), e.g. 1GiB; the oldest are evicted first (default: 256MiB).",
    )
    replicas: int = option(
        1,
        type=positive_int,
        group=_REPLICAS,
        help="Engine replicas behind this one HTTP server, run by Ray Serve (pip install 'loraserve[ray]'); "
        "each gets every engine flag. A local Ray starts unless RAY_ADDRESS names a cluster to join "
        "(default: 1, one engine in this process, no Ray).",
    )
    replica_spread_queue_depth: int = option(
        DEFAULT_SPREAD_QUEUE_DEPTH,
        type=positive_int,
        group=_REPLICAS,
        help="An adapter's requests go to the replica that holds it until that many of them are in flight "
        "there; the next one goes to the least loaded other replica too (default: %(default)s).",
    )
    replica_cpus: float | None = option(
        None,
        type=positive_float,
        group=_REPLICAS,
        help="CPUs Ray reserves for each replica (default: this machine's cores / --replicas with a local "
        "Ray, 1 in a cluster).",
    )
    replica_gpus: float | None = option(
        None,
        type=positive_float,
        group=_REPLICAS,
        help="GPUs Ray reserves for each replica (default: 1 with --device cuda, else 0).",
    )

    def __post_init__(self) -> None:
        check_options(self)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerConfig:
        return cls(**{f.name: getattr(args, f.name) for f in fields(cls) if hasattr(args, f.name)})
