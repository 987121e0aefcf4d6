"""The Responses API's server-sent events: `event: <type>` and `data: {...}` with OpenAI's
`sequence_number`, counted from 0 in each stream, so the openai client's `responses.stream()` helper
assembles the events into the response object the non-streamed call returns.

A stream is: `response.created`, `response.in_progress`, per output item `response.output_item.added`,
(a message) `response.content_part.added`, `response.output_text.delta`..., `response.output_text.done`,
`response.content_part.done`, (a function call) `response.function_call_arguments.delta`...,
`response.function_call_arguments.done`, then `response.output_item.done`; last
`response.completed`, `response.incomplete` (cut by max_output_tokens) or `response.failed`.
"""

from __future__ import annotations

import json
from typing import Any

from loraserve.entrypoints.openai.serving.responses.protocol import ResponseObject

# The last event of a response of each status.
TERMINAL_EVENTS = {
    "completed": "response.completed",
    "incomplete": "response.incomplete",
    "failed": "response.failed",
    "cancelled": "response.failed",
}


class EventWriter:
    """Numbers and formats one stream's events; each is serialized when written (the items it carries
    go on changing)."""

    def __init__(self) -> None:
        self.sequence_number = 0

    def event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self.sequence_number, **fields}
        self.sequence_number += 1
        return f"event: {kind}\ndata: {json.dumps(data, ensure_ascii=False, separators=(',', ':'))}\n\n"

    def lifecycle(self, kind: str, response: ResponseObject) -> str:
        """`response.created` / `.in_progress` / a terminal event, carrying the response as it is now."""
        return self.event(kind, response=response.model_dump(mode="json"))
