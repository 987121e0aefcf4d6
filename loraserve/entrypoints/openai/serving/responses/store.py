"""ResponseStore: the responses created with `store: true`, for GET /v1/responses/{id}, cancel and
`previous_response_id`, bounded in count and in bytes (`--responses-store-max-responses`,
`--responses-store-max-bytes`); the oldest go first.

Each entry holds the response object (as JSON-ready data) and the conversation it ends (the chat
messages of every earlier turn, its input and its output, without instructions), which a request
naming it as `previous_response_id` continues; its size is those two serialized. A background
response still running is pinned (never evicted: its task must find it), and the pinned ones are at
most `max_responses`. A response that no longer fits is gone: its id is a 404 naming it.

A response belongs to the API key that created it (`--api-key-file`): another key's id is the same
404 as an id never stored, for GET, DELETE, cancel and `previous_response_id`; `--api-key` keys (and
admin keys) reach every response, as before.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import OrderedDict
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Any

from loraserve.entrypoints.openai.serving.client_identity import current_client
from loraserve.entrypoints.openai.serving.errors import APIError

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class StoredResponse:
    response: dict[str, Any]  # ResponseObject.model_dump(mode="json")
    conversation: list[dict[str, Any]]
    size: int = 0  # bytes of the two, serialized
    task: asyncio.Task | None = None  # a background response's generation, while it runs
    owner: str | None = None  # the client id of the key that created it (None: no keys)


@dataclass(slots=True)
class ResponseStore:
    max_responses: int = 1024
    max_bytes: int = 256 << 20
    _entries: OrderedDict[str, StoredResponse] = field(default_factory=OrderedDict)
    _bytes: int = 0

    def __len__(self) -> int:
        return len(self._entries)

    def contains(self, response_id: str) -> bool:
        return response_id in self._entries

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(
        self, response: dict[str, Any], conversation: list[dict[str, Any]], task: asyncio.Task | None = None
    ) -> None:
        """Store (or replace) `response`, newest last; evict the oldest unpinned ones beyond the limits."""
        response_id = response["id"]
        old = self._entries.pop(response_id, None)
        owner = current_client().api_key
        if old is not None:
            self._bytes -= old.size
            task = task or old.task
            owner = old.owner
        size = len(json.dumps(response, separators=(",", ":"))) + len(
            json.dumps(conversation, separators=(",", ":"))
        )
        self._entries[response_id] = StoredResponse(response, conversation, size, task, owner)
        self._bytes += size
        self._evict()

    def finished(self, response_id: str) -> None:
        """A background response's generation ended: it may be evicted like any other."""
        entry = self._entries.get(response_id)
        if entry is not None:
            entry.task = None
            self._evict()

    def get(self, response_id: str, param: str | None = None) -> StoredResponse:
        """The entry, or a 404 naming the id (vLLM's text)."""
        entry = self._entries.get(response_id)
        client = current_client()
        if entry is None or not (client.scope.admin or entry.owner == client.api_key):
            raise not_found(response_id, param)
        return entry

    def delete(self, response_id: str) -> StoredResponse:
        entry = self.get(response_id)
        del self._entries[response_id]
        self._bytes -= entry.size
        return entry

    def num_running(self) -> int:
        return sum(1 for entry in self._entries.values() if entry.task is not None)

    def _evict(self) -> None:
        while len(self._entries) > self.max_responses or self._bytes > self.max_bytes:
            victim = next((key for key, entry in self._entries.items() if entry.task is None), None)
            if victim is None:  # only running background responses left: they stay until they end
                return
            entry = self._entries.pop(victim)
            self._bytes -= entry.size
            logger.debug("Response %s evicted from the store (%d bytes).", victim, entry.size)


def not_found(response_id: str, param: str | None = None) -> APIError:
    return APIError(
        f"Response with id '{response_id}' not found. Stored responses are kept while the store holds "
        "them (--responses-store-max-responses, --responses-store-max-bytes; the oldest are evicted first), "
        "and only those created with store=true.",
        HTTPStatus.NOT_FOUND,
        param,
    )
