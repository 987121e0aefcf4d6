"""The `x-loraserve-replica` response header: which engine replica(s) served a request.

`ReplicaHeaderMiddleware` gives each HTTP request a fresh set in a context variable; the replica client
adds the id of every replica that takes up one of the request's prompts (child tasks share the set);
the header is written when the response starts (a stream starts only after its first chunk, so the
replica is known by then). A response no replica took part in (validation errors, /v1/models,
/health) says "ingress".
"""

from __future__ import annotations

from contextvars import ContextVar
from typing import Any

REPLICA_HEADER = b"x-loraserve-replica"
NO_REPLICA = "ingress"

_replicas_of_request: ContextVar[set[str] | None] = ContextVar("loraserve_replicas_of_request", default=None)


def note_replica(replica_id: str) -> None:
    """Record that `replica_id` serves (part of) the current HTTP request."""
    replicas = _replicas_of_request.get()
    if replicas is not None:
        replicas.add(replica_id)


class ReplicaHeaderMiddleware:
    """Pure ASGI middleware (no buffering, so streams pass through as they are produced)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        replicas: set[str] = set()
        token = _replicas_of_request.set(replicas)

        async def send_with_header(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                value = ",".join(sorted(replicas)) or NO_REPLICA
                message = {**message, "headers": [*message.get("headers", []), (REPLICA_HEADER, value.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_header)
        finally:
            _replicas_of_request.reset(token)
