"""The HTTP layer's own limits, enforced before any route runs: how large a request body may be, how
long it may take to arrive, and no new work while the server drains for shutdown.

`RequestGuardMiddleware` is raw ASGI. It reads a request's whole body (at most `max_body_bytes`, all
within `read_timeout_s`) before the app sees the request, then replays it: a huge body costs one
bounded buffer and a 413, a trickling one (slowloris on the body) a 408, and neither ever reaches a
handler. Requests without a body pass straight through.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

_BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
_OPEN_WHILE_DRAINING = frozenset({b"/metrics"})


@dataclass(slots=True)
class ServerLifecycle:
    """Shared by the app and the server around it: set when shutdown begins."""

    is_draining: bool = False


def app_path(scope: Scope) -> bytes:
    """The raw request path as the app's routes see it: without --root-path's prefix (uvicorn adds it
    to both `path` and `raw_path`), nothing else normalised."""
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    root = (scope.get("root_path") or "").encode()
    if root and raw.startswith(root) and raw[len(root) : len(root) + 1] in (b"", b"/", b"?"):
        return raw[len(root) :] or b"/"
    return bytes(raw)


async def send_json_error(
    send: Send, status: int, message: str, error_type: str, headers: list[tuple[bytes, bytes]] | None = None
) -> None:
    """An OpenAI-style error response, sent from middleware (outside FastAPI's handlers)."""
    body = json.dumps(
        {"error": {"message": message, "type": error_type, "param": None, "code": status}}
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *(headers or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class RequestGuardMiddleware:
    def __init__(
        self, app: ASGIApp, max_body_bytes: int, read_timeout_s: float, lifecycle: ServerLifecycle
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.lifecycle = lifecycle

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.is_draining and app_path(scope) not in _OPEN_WHILE_DRAINING:
            await send_json_error(
                send, 503, "The server is shutting down and accepts no new requests.",
                "ServiceUnavailableError", [(b"connection", b"close"), (b"retry-after", b"1")],
            )
            return
        if scope.get("method", "GET") in _BODYLESS_METHODS:
            await self.app(scope, receive, send)
            return
        if self._declared_length(scope) > self.max_body_bytes:
            await self._too_large(send)
            return
        body = await self._read_body(receive, send)
        if body is None:
            return
        await self.app(scope, _Replay(body, receive), send)

    async def _read_body(self, receive: Receive, send: Send) -> bytes | None:
        """The whole body; None once an error was sent (or the client left)."""
        chunks: list[bytes] = []
        size = 0
        try:
            async with asyncio.timeout(self.read_timeout_s):
                while True:
                    message = await receive()
                    if message["type"] == "http.disconnect":
                        return None
                    chunk = message.get("body", b"")
                    size += len(chunk)
                    if size > self.max_body_bytes:
                        await self._too_large(send)
                        return None
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            await send_json_error(
                send, 408, f"The request body did not arrive within {self.read_timeout_s:g} s.",
                "RequestTimeoutError", [(b"connection", b"close")],
            )
            return None

    async def _too_large(self, send: Send) -> None:
        await send_json_error(
            send, 413, f"The request body is larger than this server accepts ({self.max_body_bytes} bytes).",
            "RequestTooLargeError", [(b"connection", b"close")],
        )

    @staticmethod
    def _declared_length(scope: Scope) -> int:
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    return int(value)
                except ValueError:
                    return 0  # h11 refuses a malformed length before the app sees the request
        return 0


class _Replay:
    """The buffered body as one message, then the connection's own messages (disconnect detection)."""

    def __init__(self, body: bytes, receive: Receive) -> None:
        self.body: bytes | None = body
        self.receive = receive

    async def __call__(self) -> Message:
        if self.body is not None:
            body, self.body = self.body, None
            return {"type": "http.request", "body": body, "more_body": False}
        return await self.receive()
