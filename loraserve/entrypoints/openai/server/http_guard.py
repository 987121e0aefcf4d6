"""The HTTP layer's own limits, enforced before any route runs: which HTTP versions are spoken, how
large a request body may be, how long it may take to arrive, and no new work while the server drains
for shutdown.

`HTTPVersionMiddleware` (outermost) answers anything but HTTP/1.0 and HTTP/1.1 with a 505: h11 parses
any `HTTP/d.d` and would serve `HTTP/9.9` as if it were 1.1.

`RequestGuardMiddleware` is raw ASGI. It reads a request's whole body (at most `max_body_bytes`, all
within `read_timeout_s`) before the app sees the request, then replays it: a huge body costs one
bounded buffer and a 413, a trickling one (slowloris on the body) a 408, and neither ever reaches a
handler. A body nesting JSON deeper than `json_limits.MAX_JSON_DEPTH` is a 400 naming the top-level
field it is too deep in, counted on the bytes before anything decodes it (decoding and validating
recurse once per level: 100k `[` was a RecursionError, a 500 and a thousand-line traceback).
Requests without a body pass straight through. It also counts the requests it lets in
(`ServerLifecycle.active_requests`), which the drain waits for.

A refusal sent before the body is read (413, 505, the drain's 503) is sent first and the rest of the
body then read and dropped (`Drain`: at most 4x the body limit, within the read timeout) before the
response ends and the connection closes: closing a socket with unread data sends a reset, which can
reach the client before the refusal does.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from loraserve.json_limits import MAX_JSON_DEPTH, deepest_member, json_depth

_BODYLESS_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "DELETE"})
_OPEN_WHILE_DRAINING = frozenset({b"/metrics"})
_HTTP_VERSIONS = frozenset({"1.0", "1.1"})
_CLOSE = (b"connection", b"close")
# How much of a refused body is read and dropped: 4x the limit (16 MiB at the default 4 MiB), at least
# 1 MiB; a larger body is not worth the bandwidth, and its client may see a reset.
DRAIN_FACTOR = 4
MIN_DRAIN_BYTES = 1 << 20
# A refusal of a request without a body limit (the version check) drains at most this much, this long.
_VERSION_DRAIN_BYTES = MIN_DRAIN_BYTES
_VERSION_DRAIN_S = 5.0


@dataclass(slots=True)
class ServerLifecycle:
    """Shared by the app and the server around it: set when shutdown begins; the requests let in."""

    is_draining: bool = False
    active_requests: int = 0  # requests past the guard whose response has not ended (event loop only)


def app_path(scope: Scope) -> bytes:
    """The raw request path as the app's routes see it: without --root-path's prefix (uvicorn adds it
    to both `path` and `raw_path`), nothing else normalised."""
    raw = scope.get("raw_path") or scope.get("path", "").encode()
    root = (scope.get("root_path") or "").encode()
    if root and raw.startswith(root) and raw[len(root) : len(root) + 1] in (b"", b"/", b"?"):
        return raw[len(root) :] or b"/"
    return bytes(raw)


def _error_json(status: int, message: str, error_type: str, param: str | None = None) -> bytes:
    return json.dumps(
        {"error": {"message": message, "type": error_type, "param": param, "code": status}}
    ).encode()


def _start(status: int, body: bytes, headers: list[tuple[bytes, bytes]] | None) -> Message:
    return {
        "type": "http.response.start",
        "status": status,
        "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            *(headers or []),
        ],
    }


async def send_json_error(
    send: Send,
    status: int,
    message: str,
    error_type: str,
    headers: list[tuple[bytes, bytes]] | None = None,
    param: str | None = None,
) -> None:
    """An OpenAI-style error response, sent from middleware (outside FastAPI's handlers)."""
    body = _error_json(status, message, error_type, param)
    await send(_start(status, body, headers))
    await send({"type": "http.response.body", "body": body})


@dataclass(frozen=True, slots=True)
class Drain:
    """How much of a refused request's body to read and drop, and for how long."""

    max_bytes: int
    timeout_s: float


async def refuse_and_drain(
    scope: Scope,
    receive: Receive,
    send: Send,
    drain: Drain | None,
    status: int,
    message: str,
    error_type: str,
    headers: list[tuple[bytes, bytes]] | None = None,
) -> None:
    """An error with `Connection: close`, its bytes sent before the rest of the body is read and
    dropped (`drain`; None: not read), so the connection closes with nothing left unread."""
    body = _error_json(status, message, error_type)
    await send(_start(status, body, [_CLOSE, *(headers or [])]))
    if drain is None or _waits_for_continue(scope):
        await send({"type": "http.response.body", "body": body})
        return
    await send({"type": "http.response.body", "body": body, "more_body": True})
    await discard_body(receive, drain)
    await send({"type": "http.response.body", "body": b""})


async def discard_body(receive: Receive, drain: Drain) -> None:
    """Read and drop the request's body until it ends, the client leaves, or `drain` runs out."""
    size = 0
    try:
        async with asyncio.timeout(drain.timeout_s):
            while size <= drain.max_bytes:
                message = await receive()
                if message["type"] == "http.disconnect" or not message.get("more_body", False):
                    return
                size += len(message.get("body", b""))
    except TimeoutError:
        return


def _waits_for_continue(scope: Scope) -> bool:
    """The client sent `Expect: 100-continue`: refused before a 100, it never sends the body."""
    return any(
        name == b"expect" and value.lower() == b"100-continue" for name, value in scope.get("headers", [])
    )


class HTTPVersionMiddleware:
    """505 for any HTTP version but 1.0 and 1.1, before CORS, the API key or a route sees the request."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        version = scope.get("http_version", "1.1")
        if scope["type"] != "http" or version in _HTTP_VERSIONS:
            await self.app(scope, receive, send)
            return
        await refuse_and_drain(
            scope,
            receive,
            send,
            Drain(_VERSION_DRAIN_BYTES, _VERSION_DRAIN_S),
            505,
            f"HTTP/{version} is not supported; this server speaks HTTP/1.1 and HTTP/1.0.",
            "HTTPVersionNotSupportedError",
        )


class RequestGuardMiddleware:
    def __init__(
        self, app: ASGIApp, max_body_bytes: int, read_timeout_s: float, lifecycle: ServerLifecycle
    ) -> None:
        self.app = app
        self.max_body_bytes = max_body_bytes
        self.read_timeout_s = read_timeout_s
        self.lifecycle = lifecycle
        self.drain = Drain(max(DRAIN_FACTOR * max_body_bytes, MIN_DRAIN_BYTES), read_timeout_s)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.lifecycle.is_draining and app_path(scope) not in _OPEN_WHILE_DRAINING:
            await refuse_and_drain(
                scope,
                receive,
                send,
                self.drain,
                503,
                "The server is shutting down and accepts no new requests.",
                "ServiceUnavailableError",
                [(b"retry-after", b"1")],
            )
            return
        self.lifecycle.active_requests += 1
        try:
            await self._guarded(scope, receive, send)
        finally:
            self.lifecycle.active_requests -= 1

    async def _guarded(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope.get("method", "GET") in _BODYLESS_METHODS:
            await self.app(scope, receive, send)
            return
        declared = self._declared_length(scope)
        if declared > self.max_body_bytes:
            # A body past what the drain reads is not worth reading: refused, and closed at once.
            drain = self.drain if declared <= self.drain.max_bytes else None
            await self._too_large(scope, receive, send, drain)
            return
        body = await self._read_body(scope, receive, send)
        if body is None:
            return
        depth = json_depth(body)
        if depth > MAX_JSON_DEPTH:
            field = deepest_member(body)
            where = f" (in {json.dumps(field[:80])})" if field else ""
            await send_json_error(
                send,
                400,
                f"The request body nests {depth} levels of JSON arrays and objects{where}; at most "
                f"{MAX_JSON_DEPTH} are accepted.",
                "BadRequestError",
                param=field,
            )
            return
        await self.app(scope, _Replay(body, receive), send)

    async def _read_body(self, scope: Scope, receive: Receive, send: Send) -> bytes | None:
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
                        more = message.get("more_body", False)
                        await self._too_large(scope, receive if more else _ended, send, self.drain)
                        return None
                    chunks.append(chunk)
                    if not message.get("more_body", False):
                        return b"".join(chunks)
        except TimeoutError:
            await send_json_error(
                send,
                408,
                f"The request body did not arrive within {self.read_timeout_s:g} s.",
                "RequestTimeoutError",
                [_CLOSE],
            )
            return None

    async def _too_large(self, scope: Scope, receive: Receive, send: Send, drain: Drain | None) -> None:
        await refuse_and_drain(
            scope,
            receive,
            send,
            drain,
            413,
            f"The request body is larger than this server accepts ({self.max_body_bytes} bytes).",
            "RequestTooLargeError",
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


async def _ended() -> Message:
    """`receive` for a body already read to its end: nothing more to drain."""
    return {"type": "http.request", "body": b"", "more_body": False}


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
