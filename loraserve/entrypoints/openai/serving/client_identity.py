"""Who sent a request, as fair admission and the tokenizer pool count clients.

`ClientIdentityMiddleware` (raw ASGI, inside the API-key check) records, for the request's context,
which configured API key it carries (`key-<i>`: an index, never the key) and its peer address.
Fair shares of the queue are per API key only (a peer address is a proxy's as often as a person's:
capping it would cap everyone behind it); the peer address only orders the tokenizer's work, where a
wrong guess costs nothing but order.
"""

from __future__ import annotations

import hmac
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send


@dataclass(frozen=True, slots=True)
class ClientIdentity:
    api_key: str | None = None  # "key-<i>" for the i-th configured key; None without keys
    peer: str | None = None  # the connection's peer host

    @property
    def fairness_key(self) -> str | None:
        """Whose turn a piece of work counts in: the key's, else the peer's."""
        return self.api_key if self.api_key is not None else self.peer


_CURRENT: ContextVar[ClientIdentity | None] = ContextVar("loraserve_client", default=None)
_NOBODY = ClientIdentity()


def current_client() -> ClientIdentity:
    """The identity of the request being served in this context (empty outside a request)."""
    return _CURRENT.get() or _NOBODY


class ClientIdentityMiddleware:
    def __init__(self, app: ASGIApp, api_keys: list[str]) -> None:
        self.app = app
        self.expected = [f"Bearer {key}".encode() for key in api_keys]

    def key_id(self, scope: Scope) -> str | None:
        given = next(
            (value for name, value in scope.get("headers", []) if name.lower() == b"authorization"), b""
        )
        found: str | None = None
        for index, expected in enumerate(self.expected):
            # Every key compared in constant time, as the API-key check does: timing reveals nothing.
            if hmac.compare_digest(given, expected) and found is None:
                found = f"key-{index}"
        return found

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        peer = scope.get("client")
        token = _CURRENT.set(ClientIdentity(self.key_id(scope), str(peer[0]) if peer else None))
        try:
            await self.app(scope, receive, send)
        finally:
            _CURRENT.reset(token)
