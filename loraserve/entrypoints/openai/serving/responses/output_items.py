"""A response's output items, built from the chat path's generated text as it grows: a `message`
item (one `output_text` part) for the content, one `function_call` item per tool call, in the order
the text holds them (a parser's content precedes its calls).

The text is read for calls by the chat path's tool parser (`ToolPlan.parser`, the same parsers and
forced-choice grammars as chat completions) through `ToolCallStream`, which sends each step's
difference; `OutputAssembler` turns those differences into items and, when it streams, into the
events that announce them. The non-streamed response is the same assembly over the finished text, so
both build the same items. An item is done when the next one starts or the output ends; the last one
is "incomplete" when the output was cut by max_output_tokens.
"""

from __future__ import annotations

from typing import Any

from loraserve.entrypoints.openai.serving.responses.events import EventWriter
from loraserve.entrypoints.openai.serving.responses.protocol import new_id
from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import ToolParser
from loraserve.entrypoints.openai.tool_parsers.json_scan import escaped_controls
from loraserve.entrypoints.openai.tool_parsers.streaming import StreamDelta, ToolCallStream


class OutputAssembler:
    """One response's output items; with an `EventWriter`, the stream's events for them."""

    def __init__(
        self,
        parser: ToolParser | None,
        max_calls: int | None,
        events: EventWriter | None,
        json_text: bool = False,
    ) -> None:
        self.calls = ToolCallStream(parser, lambda: new_id("call"), max_calls) if parser is not None else None
        self.events = events
        # A JSON text format: control characters a grammar let into strings are escaped, so that strict
        # parsers (`responses.parse`, the Agents SDK's output types) read the text.
        self.json_text = json_text
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None  # the item being written
        self._call_items: dict[int, dict[str, Any]] = {}  # the parser's call index -> its item
        self._text_sent = 0  # without a parser: the characters of the text already in items
        self._lines: list[str] = []

    @property
    def tools_called(self) -> bool:
        return bool(self._call_items)

    def update(self, text: str, final: bool) -> list[str]:
        """Read `text` (the whole output so far); the events for what it adds."""
        if self.json_text:
            text = escaped_controls(text)
        if self.calls is not None:
            deltas = self.calls.update(text, final)
        else:
            deltas = [StreamDelta(content=text[self._text_sent :])] if len(text) > self._text_sent else []
            self._text_sent = len(text)
        for delta in deltas:
            call = delta.tool_call
            if delta.content:
                self._text(delta.content)
            elif call is not None and call.name is not None:
                self._start_call(call.index, call.id or new_id("call"), call.name)
            elif call is not None and call.index in self._call_items:
                self._arguments(self._call_items[call.index], call.arguments)
        return self._take_lines()

    def finish(self, incomplete: bool) -> list[str]:
        """Close the last item ("incomplete" when the output was cut); an output with nothing in it is
        one empty message, as OpenAI answers an empty generation."""
        if not self.items:
            self._open_message()
        self._close("incomplete" if incomplete else "completed")
        return self._take_lines()

    def _text(self, piece: str) -> None:
        if self._open is None or self._open["type"] != "message":
            self._open_message()
        item = self._open
        assert item is not None
        part = item["content"][0]
        part["text"] += piece
        self._emit(
            "response.output_text.delta",
            item_id=item["id"],
            output_index=self._index(item),
            content_index=0,
            delta=piece,
            logprobs=[],
        )

    def _open_message(self) -> None:
        item: dict[str, Any] = {
            "id": new_id("msg"), "type": "message", "status": "in_progress", "role": "assistant", "content": []
        }  # fmt: skip
        self._add(item)
        part: dict[str, Any] = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        self._emit(
            "response.content_part.added",
            item_id=item["id"],
            output_index=self._index(item),
            content_index=0,
            part=part,
        )
        item["content"].append(part)

    def _start_call(self, index: int, call_id: str, name: str) -> None:
        item = {"id": new_id("fc"), "type": "function_call", "status": "in_progress", "call_id": call_id,
                "name": name, "arguments": ""}  # fmt: skip
        self._call_items[index] = item
        self._add(item)

    def _arguments(self, item: dict[str, Any], piece: str) -> None:
        if not piece:
            return
        item["arguments"] += piece
        self._emit(
            "response.function_call_arguments.delta",
            item_id=item["id"],
            output_index=self._index(item),
            delta=piece,
        )

    def _add(self, item: dict[str, Any]) -> None:
        self._close("completed")
        self.items.append(item)
        self._open = item
        self._emit("response.output_item.added", output_index=len(self.items) - 1, item=item)

    def _close(self, status: str) -> None:
        item, self._open = self._open, None
        if item is None:
            return
        index = self._index(item)
        item["status"] = status
        if item["type"] == "message":
            part = item["content"][0]
            self._emit("response.output_text.done", item_id=item["id"], output_index=index, content_index=0,
                       text=part["text"], logprobs=[])  # fmt: skip
            self._emit(
                "response.content_part.done",
                item_id=item["id"],
                output_index=index,
                content_index=0,
                part=part,
            )
        else:
            self._emit("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                       arguments=item["arguments"])  # fmt: skip
        self._emit("response.output_item.done", output_index=index, item=item)

    def _index(self, item: dict[str, Any]) -> int:
        return next(i for i, other in enumerate(self.items) if other is item)

    def _emit(self, kind: str, **fields: Any) -> None:
        if self.events is not None:
            self._lines.append(self.events.event(kind, **fields))

    def _take_lines(self) -> list[str]:
        lines, self._lines = self._lines, []
        return lines
