"""FrontendOptions: the HTTP front end's options, as vLLM's `FrontendArgs` names them, declared once as
option fields (`loraserve.options`): CORS, root path, docs, extra ASGI middleware, X-Request-Id
headers, the chat response role, template and content format, tool calling (auto tool choice, the
parser and its plugin file), token ids as logprob tokens, TLS, a
Unix socket, uvicorn's log level and access log, h11's event size, a logging config file. Their
`serve` flags are generated from the fields; `frontend.py` applies them. Names, value forms and
defaults are vLLM's (v0.11). Free of torch and FastAPI, like all flag parsing.
"""

from __future__ import annotations

import argparse
import json
import ssl
from dataclasses import dataclass, fields
from typing import Any

from loraserve.options import check_options, option

CONTENT_FORMATS = ("auto", "string")  # vLLM's "openai" (content as a list of parts) is not rendered
_GROUP = "HTTP front end"
_CORS_HELP = "CORS: allowed {} as a JSON list (default: '[\"*\"]')."


def json_list(value: str) -> list[str]:
    """vLLM's CORS lists: a JSON list of strings, e.g. '["http://localhost:3000"]'."""
    try:
        parsed = json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"expected a JSON list such as '[\"*\"]', got {value!r}") from exc
    if not isinstance(parsed, list) or not all(isinstance(item, str) for item in parsed):
        raise argparse.ArgumentTypeError(f"expected a JSON list of strings, got {value!r}")
    return parsed


def _tls_pair(options: Any) -> str | None:
    if bool(options.ssl_keyfile) != bool(options.ssl_certfile):
        return "ssl_keyfile and ssl_certfile go together."
    return None


def _tool_parser_given(options: Any) -> str | None:
    if options.enable_auto_tool_choice and not options.tool_call_parser:
        return "enable_auto_tool_choice requires tool_call_parser"  # vLLM's text, in flag names
    return None


def _front(default: Any, help: str = "", **kwargs: Any) -> Any:
    return option(default, help=help, group=_GROUP, **kwargs)


@dataclass(frozen=True, slots=True)
class FrontendOptions:
    __option_checks__ = (_tls_pair, _tool_parser_given)

    uds: str | None = _front(None, "Listen on this Unix domain socket instead of host:port.")
    uvicorn_log_level: str | None = _front(  # None: LORASERVE_LOGGING_LEVEL's
        None, choices=("debug", "info", "warning", "error", "critical", "trace")
    )
    disable_uvicorn_access_log: bool = _front(False, action="bool")
    allow_credentials: bool = _front(False, "CORS: allow credentials.", action="bool")
    allowed_origins: tuple[str, ...] = _front(("*",), _CORS_HELP.format("origins"), type=json_list)
    allowed_methods: tuple[str, ...] = _front(("*",), _CORS_HELP.format("methods"), type=json_list)
    allowed_headers: tuple[str, ...] = _front(("*",), _CORS_HELP.format("headers"), type=json_list)
    root_path: str | None = _front(None, "FastAPI root_path behind a path-routing proxy.")
    disable_fastapi_docs: bool = _front(False, "No /docs, /redoc, /openapi.json.", action="bool")
    middleware: tuple[str, ...] = _front(
        (), "Import path of an ASGI middleware class or async function (repeatable).", action="append"
    )
    enable_request_id_headers: bool = _front(False, "Add X-Request-Id to every response.", action="bool")
    response_role: str = _front("assistant", "Role of the chat completion message (assistant).")
    chat_template: str | None = _front(  # a file path or the template itself
        None, "Chat template file, or the template itself, replacing the tokenizer's."
    )
    chat_template_content_format: str = _front(
        "auto",
        "Message content is rendered as a string (vLLM's 'openai' format is not offered).",
        choices=CONTENT_FORMATS,
    )
    return_tokens_as_token_ids: bool = _front(
        False, 'Logprob tokens as "token_id:<id>" for every request.', action="bool"
    )
    enable_auto_tool_choice: bool = _front(
        False,
        'tool_choice "auto" (the default when a request has tools): the output is read for calls by '
        "--tool-call-parser.",
        action="bool",
    )
    tool_call_parser: str | None = _front(
        None,
        "How the model writes tool calls: hermes (Qwen2.5, Hermes, SmolLM), llama3_json, mistral, "
        "pythonic, or a name a --tool-parser-plugin registers.",
    )
    tool_parser_plugin: str = _front(
        "", "A Python file that registers tool parsers (@ToolParserManager.register_module)."
    )
    exclude_tools_when_tool_choice_none: bool = _front(
        False, 'With tool_choice "none" the tools are not shown to the chat template.', action="bool"
    )
    enable_prompt_tokens_details: bool = _front(
        False,
        "usage.prompt_tokens_details.cached_tokens: prompt tokens served from the prefix cache.",
        action="bool",
    )
    enable_server_load_tracking: bool = _front(
        False, "GET /load counts the generation requests in flight.", action="bool"
    )
    enable_tokenizer_info_endpoint: bool = _front(
        False, "GET /tokenizer_info returns the tokenizer's configuration.", action="bool"
    )
    ssl_keyfile: str | None = _front(None)
    ssl_certfile: str | None = _front(None)
    ssl_ca_certs: str | None = _front(None)
    ssl_cert_reqs: int = _front(
        int(ssl.CERT_NONE),
        f"Client certificates: {int(ssl.CERT_NONE)} none, {int(ssl.CERT_OPTIONAL)} optional, "
        f"{int(ssl.CERT_REQUIRED)} required.",
        type=int,
    )
    h11_max_incomplete_event_size: int | None = _front(
        None, "Largest incomplete HTTP event (header or body part) in bytes.", type=int
    )
    log_config_file: str | None = _front(None, "logging.config JSON for loraserve and uvicorn.")

    def __post_init__(self) -> None:
        check_options(self)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> FrontendOptions:
        values = {
            f.name: getattr(args, f.name) for f in fields(cls) if getattr(args, f.name, None) is not None
        }
        for name in ("allowed_origins", "allowed_methods", "allowed_headers", "middleware"):
            if name in values:
                values[name] = tuple(values[name])
        return cls(**values)


def frontend_dests() -> set[str]:
    """The `serve` flags' dests that FrontendOptions reads."""
    return {f.name for f in fields(FrontendOptions)}
