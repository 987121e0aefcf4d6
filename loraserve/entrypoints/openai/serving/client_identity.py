"""Who sent a request, as fair admission, the tokenizer pool and the key scopes count clients.

`ClientIdentityMiddleware` (raw ASGI, inside the API-key check) records, for the request's context,
which configured API key it carries (its client id: `key-<i>` for the i-th `--api-key`, `key:<label>`
for a key-file key; never the key), that key's scope (`key_scopes.KeyScope`: which adapters it
reaches, its limits) and the peer address. Fair shares of the queue are per API key only (a peer
address is a proxy's as often as a person's: capping it would cap everyone behind it); the peer
address only orders the tokenizer's and the grammar compiler's work, where a wrong guess costs
nothing but order.
"""

from __future__ import annotations

from collections.abc import Callable
from contextvars import ContextVar
from dataclasses import dataclass

from starlette.types import ASGIApp, Receive, Scope, Send

from loraserve.entrypoints.openai.serving.key_scopes import ADMIN, KeyScope


@dataclass(frozen=True, slots=True)
class ClientIdentity:
    api_key: str | None = None  # the key's client id ("key-<i>", "key:<label>"); None without keys
    peer: str | None = None  # the connection's peer host
    scope: KeyScope = ADMIN  # what the key may reach (no keys: everything)

    @property
    def fairness_key(self) -> str | None:
        """Whose turn a piece of work counts in: the key's, else the peer's."""
        return self.api_key if self.api_key is not None else self.peer

    @property
    def label(self) -> str:
        """The key's configured label, for metrics and logs ("" without a key)."""
        return self.scope.label if self.api_key is not None else ""


_CURRENT: ContextVar[ClientIdentity | None] = ContextVar("loraserve_client", default=None)
_NOBODY = ClientIdentity()


def current_client() -> ClientIdentity:
    """The identity of the request being served in this context (empty outside a request)."""
    return _CURRENT.get() or _NOBODY


class ClientIdentityMiddleware:
    """`scope_of(authorization header) -> KeyScope | None` is the key store's lookup (constant time
    over every key); `on_request(label)` counts a keyed request (metrics)."""

    def __init__(
        self,
        app: ASGIApp,
        scope_of: Callable[[bytes], KeyScope | None],
        on_request: Callable[[str], None] | None = None,
    ) -> None:
        self.app = app
        self.scope_of = scope_of
        self.on_request = on_request

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        given = next(
            (value for name, value in scope.get("headers", []) if name.lower() == b"authorization"), b""
        )
        key_scope = self.scope_of(given) if given else None
        peer = scope.get("client")
        identity = ClientIdentity(
            key_scope.client_id if key_scope is not None else None,
            str(peer[0]) if peer else None,
            key_scope if key_scope is not None else ADMIN,
        )
        if key_scope is not None and self.on_request is not None:
            self.on_request(key_scope.label)
        token = _CURRENT.set(identity)
        try:
            await self.app(scope, receive, send)
        finally:
            _CURRENT.reset(token)
