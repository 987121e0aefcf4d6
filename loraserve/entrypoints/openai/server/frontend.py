"""How the HTTP front end's own options apply (`FrontendOptions`, declared in `frontend_options.py`).

`apply_to_app` wires CORS (outermost, so preflight requests never meet the API key check), the
request-id header and the user's middleware; `uvicorn_options` gives uvicorn its TLS and log settings.
"""

from __future__ import annotations

import importlib
import inspect
import json
import logging.config
import os
import socket
import uuid
from collections.abc import Awaitable, Callable
from typing import Any, cast

from fastapi import FastAPI

from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions

logger = logging.getLogger("loraserve.server")


def fastapi_kwargs(options: FrontendOptions) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if options.disable_fastapi_docs:
        kwargs.update(openapi_url=None, docs_url=None, redoc_url=None)
    return kwargs


def apply_to_app(app: FastAPI, options: FrontendOptions) -> None:
    """Middleware in vLLM's order: the user's, the request id, then CORS outermost."""
    for path in options.middleware:
        _add_user_middleware(app, path)
    if options.enable_request_id_headers:
        app.add_middleware(RequestIdMiddleware)
    from starlette.middleware.cors import CORSMiddleware

    app.add_middleware(
        CORSMiddleware,
        allow_origins=list(options.allowed_origins),
        allow_credentials=options.allow_credentials,
        allow_methods=list(options.allowed_methods),
        allow_headers=list(options.allowed_headers),
    )


def _add_user_middleware(app: FastAPI, path: str) -> None:
    """`module.attr`: a class goes in with add_middleware, a function as an @app.middleware("http")."""
    module_name, _, attr = path.rpartition(".")
    try:
        target: Any = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError, ValueError) as exc:
        raise ValueError(f"--middleware {path!r}: cannot import it ({exc}).") from exc
    if inspect.isclass(target):
        app.add_middleware(cast(Any, target))  # any ASGI middleware class; starlette types it narrowly
    elif inspect.iscoroutinefunction(target):
        app.middleware("http")(target)
    else:
        raise ValueError(f"--middleware {path!r} must be an ASGI middleware class or an async function.")


class RequestIdMiddleware:
    """X-Request-Id on every response: the client's own, else a new one (vLLM's --enable-request-id-headers)."""

    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = dict(scope.get("headers") or []).get(b"x-request-id")
        request_id = given or uuid.uuid4().hex.encode()

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), (b"x-request-id", request_id)]
            await send(message)

        await self.app(scope, receive, send_with_id)


def load_chat_template(value: str | None) -> str | None:
    """A --chat-template value: the file's text when it names a file, else the template itself."""
    if value is None:
        return None
    path = os.path.expanduser(value)
    if os.path.isfile(path):
        with open(path, encoding="utf-8") as f:
            return f.read()
    if "{" not in value:  # neither a file nor a Jinja template: most likely a mistyped path
        raise ValueError(f"--chat-template {value!r} is neither a file nor a Jinja template.")
    return value


def override_chat_template(tokenizer: Any, options: FrontendOptions) -> None:
    """--chat-template replaces the tokenizer's template for every chat request."""
    template = load_chat_template(options.chat_template)
    if template is None:
        return
    if tokenizer is None:
        raise ValueError("--chat-template needs a tokenizer, and the server runs with --skip-tokenizer-init.")
    tokenizer.chat_template = template


def uvicorn_options(options: FrontendOptions) -> dict[str, Any]:
    """uvicorn.Config keywords for TLS, log level, access log, root path and h11's event size."""
    values: dict[str, Any] = {
        "access_log": not options.disable_uvicorn_access_log,
        "root_path": options.root_path or "",  # the ASGI root_path, as FastAPI asks (not its own parameter)
    }
    if options.uvicorn_log_level is not None:
        values["log_level"] = options.uvicorn_log_level
    if options.ssl_keyfile or options.ssl_certfile:
        values.update(
            ssl_keyfile=options.ssl_keyfile,
            ssl_certfile=options.ssl_certfile,
            ssl_ca_certs=options.ssl_ca_certs,
            ssl_cert_reqs=options.ssl_cert_reqs,
        )
    if options.h11_max_incomplete_event_size is not None:
        values["h11_max_incomplete_event_size"] = options.h11_max_incomplete_event_size
    return values


def bind_unix_socket(path: str) -> socket.socket:
    """--uds: listen on a Unix domain socket instead of host:port (a stale socket file is replaced)."""
    if os.path.exists(path) and not os.path.isdir(path):
        os.unlink(path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.bind(path)
    except OSError as exc:
        sock.close()
        raise OSError(f"cannot listen on unix socket {path}: {exc.strerror or exc}") from exc
    return sock


def apply_log_config(path: str | None) -> None:
    """--log-config-file: a logging.config.dictConfig JSON file for loraserve's and uvicorn's loggers."""
    if path is None:
        return
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            config = json.load(f)
        logging.config.dictConfig(config)
    except (OSError, ValueError, TypeError) as exc:
        raise ValueError(f"--log-config-file {path!r}: {exc}") from exc
