"""The `vllm serve` flags that work here and that `cli_args.py` does not define itself.

Engine flags (dest = an `EngineArgs` field): revision, tokenizer mode and revision, config and load
formats, download dir, skip_tokenizer_init, max_logprobs, generation config, chunked prefill, RoPE
overrides, a fixed number of KV blocks. Front-end flags (dest = a `FrontendOptions` field): Unix socket,
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


def json_value(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {exc.msg}") from exc


def add_vllm_engine_args(group: Any) -> None:
    group.add_argument("--revision", default=None, help="Model revision on the Hub (branch, tag or commit).")
    group.add_argument("--tokenizer-revision", default=None, help="Tokenizer revision on the Hub.")
    group.add_argument(
        "--tokenizer-mode", default=None, choices=["auto", "slow"], help="auto: the fast tokenizer when there is one."
    )
    group.add_argument("--config-format", default=None, choices=["auto", "hf", "mistral"],
                       help="auto: params.json (Mistral) when present, else config.json.")
    group.add_argument(
        "--load-format", default=None, choices=["auto", "safetensors", "pt", "dummy", "gguf", "mistral"],
        help="Which weight files to read; dummy = random weights (profiling).",
    )
    group.add_argument("--download-dir", default=None, help="Hugging Face cache folder for downloads.")
    group.add_argument("--skip-tokenizer-init", action=_BOOL, default=None,
                       help="No tokenizer: prompts must be token ids, completions carry no text.")
    group.add_argument("--max-logprobs", type=int, default=None,
                       help="Most logprobs a request may ask for (default: 20; -1: the vocabulary size).")
    group.add_argument(
        "--generation-config", default=None,
        help="Sampling defaults: auto (the model's generation_config.json, default), vllm (none) or a folder.",
    )
    group.add_argument("--override-generation-config", type=json_value, default=None,
                       help='JSON sampling defaults, e.g. \'{"temperature": 0.5}\'.')
    group.add_argument("--enable-chunked-prefill", action=_BOOL, default=None,
                       help="Split long prompts across steps (default: on).")
    group.add_argument("--rope-scaling", type=json_value, default=None, help="JSON rope_scaling for the config.")
    group.add_argument("--rope-theta", type=float, default=None, help="rope_theta for the config.")
    group.add_argument("--num-gpu-blocks-override", dest="num_kv_blocks", type=int, default=None,
                       help="Exact number of KV-cache blocks (overrides the memory budget).")


def add_vllm_frontend_args(group: Any) -> None:
    group.add_argument("--uds", default=None, help="Listen on this Unix domain socket instead of host:port.")
    group.add_argument("--uvicorn-log-level", default=None,
                       choices=["debug", "info", "warning", "error", "critical", "trace"])
    group.add_argument("--disable-uvicorn-access-log", action=_BOOL, default=None)
    group.add_argument("--allow-credentials", action=_BOOL, default=None, help="CORS: allow credentials.")
    for name in ("origins", "methods", "headers"):
        group.add_argument(f"--allowed-{name}", type=json_list, default=None,
                           help=f'CORS: allowed {name} as a JSON list (default: \'["*"]\').')
    group.add_argument("--root-path", default=None, help="FastAPI root_path behind a path-routing proxy.")
    group.add_argument("--disable-fastapi-docs", action=_BOOL, default=None, help="No /docs, /redoc, /openapi.json.")
    group.add_argument("--middleware", action="append", default=None,
                       help="Import path of an ASGI middleware class or async function (repeatable).")
    group.add_argument("--enable-request-id-headers", action=_BOOL, default=None,
                       help="Add X-Request-Id to every response.")
    group.add_argument("--response-role", default=None, help="Role of the chat completion message (assistant).")
    group.add_argument("--chat-template", default=None,
                       help="Chat template file, or the template itself, replacing the tokenizer's.")
    group.add_argument("--chat-template-content-format", default=None, choices=["auto", "string"],
                       help="Message content is rendered as a string (vLLM's 'openai' format is not offered).")
    group.add_argument("--return-tokens-as-token-ids", action=_BOOL, default=None,
                       help='Logprob tokens as "token_id:<id>" for every request.')
    group.add_argument("--ssl-keyfile", default=None)
    group.add_argument("--ssl-certfile", default=None)
    group.add_argument("--ssl-ca-certs", default=None)
    group.add_argument("--ssl-cert-reqs", type=int, default=None,
                       help=f"Client certificates: {int(ssl.CERT_NONE)} none, {int(ssl.CERT_OPTIONAL)} optional, "
                       f"{int(ssl.CERT_REQUIRED)} required.")
    group.add_argument("--h11-max-incomplete-event-size", type=int, default=None,
                       help="Largest incomplete HTTP event (header or body part) in bytes.")
    group.add_argument("--log-config-file", default=None, help="logging.config JSON for loraserve and uvicorn.")


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
    if args.max_logprobs is not None and args.max_logprobs < -1:
        parser.error(f"--max-logprobs must be >= 0 (or -1: the vocabulary size), got {args.max_logprobs}")
