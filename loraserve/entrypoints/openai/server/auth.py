"""API key enforcement (`--api-key`, `--api-key-file`): a raw ASGI middleware, so no routing quirk can
skip it.

The decision uses the raw request path exactly as received: only `/health` and `/ping` (vLLM's
SageMaker health check, which answers as `/health` does and is open in vLLM too) are open.
Percent-encoding, double slashes or `..` segments never match them, so they are checked like any
other path. Keys are compared in constant time against every configured key (`KeyStore.scope`); the
set of keys is the store's at the moment the request arrives (it changes on SIGHUP).
"""

from __future__ import annotations

from starlette.types import ASGIApp, Receive, Scope, Send

from loraserve.entrypoints.openai.server.http_guard import app_path, send_json_error
from loraserve.entrypoints.openai.server.key_store import KeyStore

OPEN_PATHS = frozenset({b"/health", b"/ping"})


class APIKeyMiddleware:
    def __init__(self, app: ASGIApp, keys: KeyStore) -> None:
        self.app = app
        self.keys = keys

    def is_authorized(self, scope: Scope) -> bool:
        given = b""
        for name, value in scope.get("headers", []):
            if name.lower() == b"authorization":
                given = value
                break
        return self.keys.scope(given) is not None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        raw_path = app_path(scope)
        if raw_path in OPEN_PATHS or self.is_authorized(scope):
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1008})
            return
        await send_json_error(
            send, 401, "Unauthorized", "AuthenticationError", [(b"www-authenticate", b"Bearer")]
        )
