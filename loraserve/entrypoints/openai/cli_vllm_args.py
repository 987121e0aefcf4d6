"""The `vllm serve` flags of the HTTP front end (vLLM's FrontendArgs) that work here.

Front-end flags (dest = a `FrontendOptions` field): Unix socket,
uvicorn log level and access log, CORS, root path, docs, middleware, request-id headers, chat response
role, template and content format, token ids as logprob tokens, TLS, h11's event size, a logging
config file. Names, value forms and defaults are vLLM's (v0.11); like the rest of the `serve` parser,
nothing here imports torch.
"""

from __future__ import annotations

import argparse
import json
import ssl
from typing import Any

_BOOL = argparse.BooleanOptionalAction


def json_list(value: str) -> list[str]:
    """vLLM's CORS lists: a JSON list of strings, e.g. '["http://localhost:3000"]'."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON list such as '[\"*\"]', got {value!r}") from exc
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def add_vllm_frontend_args(group: Any) -> None:
    group.add_argument("--uds", default=None, help="Listen on this Unix domain socket instead of host:port.")
    group.add_argument(
        "--uvicorn-log-level",
        default=None,
        choices=["debug", "info", "warning", "error", "critical", "trace"],
    )
    group.add_argument("--disable-uvicorn-access-log", action=_BOOL, default=None)
    group.add_argument("--allow-credentials", action=_BOOL, default=None, help="CORS: allow credentials.")
    for name in ("origins", "methods", "headers"):
        group.add_argument(
            f"--allowed-{name}",
            type=json_list,
            default=None,
            help=f"CORS: allowed {name} as a JSON list (default: '[\"*\"]').",
        )
    group.add_argument("--root-path", default=None, help="FastAPI root_path behind a path-routing proxy.")
    group.add_argument(
        "--disable-fastapi-docs", action=_BOOL, default=None, help="No /docs, /redoc, /openapi.json."
    )
    group.add_argument(
        "--middleware",
        action="append",
        default=None,
        help="Import path of an ASGI middleware class or async function (repeatable).",
    )
    group.add_argument(
        "--enable-request-id-headers", action=_BOOL, default=None, help="Add X-Request-Id to every response."
    )
    group.add_argument(
        "--response-role", default=None, help="Role of the chat completion message (assistant)."
    )
    group.add_argument(
        "--chat-template",
        default=None,
        help="Chat template file, or the template itself, replacing the tokenizer's.",
    )
    group.add_argument(
        "--chat-template-content-format",
        default=None,
        choices=["auto", "string"],
        help="Message content is rendered as a string (vLLM's 'openai' format is not offered).",
    )
    group.add_argument(
        "--return-tokens-as-token-ids",
        action=_BOOL,
        default=None,
        help='Logprob tokens as "token_id:<id>" for every request.',
    )
    group.add_argument("--ssl-keyfile", default=None)
    group.add_argument("--ssl-certfile", default=None)
    group.add_argument("--ssl-ca-certs", default=None)
    group.add_argument(
        "--ssl-cert-reqs",
        type=int,
        default=None,
        help=f"Client certificates: {int(ssl.CERT_NONE)} none, {int(ssl.CERT_OPTIONAL)} optional, "
        f"{int(ssl.CERT_REQUIRED)} required.",
    )
    group.add_argument(
        "--h11-max-incomplete-event-size",
        type=int,
        default=None,
        help="Largest incomplete HTTP event (header or body part) in bytes.",
    )
    group.add_argument(
        "--log-config-file", default=None, help="logging.config JSON for loraserve and uvicorn."
    )


def check_vllm_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Cross-flag checks of the flags above (one-line errors through `parser.error`)."""
    if bool(args.ssl_keyfile) != bool(args.ssl_certfile):
        parser.error("--ssl-keyfile and --ssl-certfile go together")
    if args.chat_template is not None:
        from loraserve.entrypoints.openai.frontend import load_chat_template

        try:
            load_chat_template(args.chat_template)
        except (OSError, ValueError) as exc:
            parser.error(str(exc))
