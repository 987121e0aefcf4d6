"""ToolCallStream: one choice's stream of tool calls, as OpenAI's delta format sends them.

Each step the whole text so far is parsed again and only the difference is sent: new content, then
per call (in order, once its name is read) a first delta with index, id, type "function", the name
and arguments "", then the arguments' new text. A parse only grows what an earlier one said (content
and arguments are prefixes of the finished values), so the pieces add up to the finished output. (A text that leaves the format after a call's name
was sent, which the finished output reads as content, cannot be taken back: the stream stops there.)
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import PartialToolCall, ToolParser

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ToolCallDelta:
    index: int
    arguments: str
    id: str | None = None  # with the name, in a call's first delta only
    name: str | None = None


@dataclass(frozen=True, slots=True)
class StreamDelta:
    content: str | None = None
    tool_call: ToolCallDelta | None = None


@dataclass(slots=True)
class _SentCall:
    id: str
    arguments: str = ""


@dataclass(slots=True)
class ToolCallStream:
    parser: ToolParser
    new_id: Callable[[], str]
    max_calls: int | None = None  # parallel_tool_calls=false: the first call only
    content: str = ""
    calls: list[_SentCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)

    def update(self, text: str, final: bool) -> list[StreamDelta]:
        """What `text` (the whole output so far) adds to what was sent."""
        content, calls = self._targets(text, final)
        deltas = []
        if content.startswith(self.content) and len(content) > len(self.content):
            deltas.append(StreamDelta(content=content[len(self.content) :]))
            self.content = content
        limit = len(calls) if self.max_calls is None else min(len(calls), self.max_calls)
        for index, call in enumerate(calls[:limit]):
            if index == len(self.calls):
                if call.name is None:
                    break
                self.calls.append(_SentCall(self.new_id()))
                deltas.append(StreamDelta(tool_call=ToolCallDelta(index, "", self.calls[-1].id, call.name)))
            sent = self.calls[index]
            if not call.arguments.startswith(sent.arguments):
                logger.debug("tool call %d's arguments changed after they were sent; not sent again", index)
                continue
            if len(call.arguments) > len(sent.arguments):
                deltas.append(
                    StreamDelta(tool_call=ToolCallDelta(index, call.arguments[len(sent.arguments) :]))
                )
                sent.arguments = call.arguments
        return deltas

    def _targets(self, text: str, final: bool) -> tuple[str, tuple[PartialToolCall, ...]]:
        if not final:
            parsed = self.parser.parse(text, final=False)
            return parsed.content, () if parsed.malformed else parsed.calls
        extracted = self.parser.extract_tool_calls(text)
        if extracted.tools_called:
            calls = tuple(PartialToolCall(c.name, c.arguments, True) for c in extracted.calls)
            return extracted.content or "", calls
        if not self.calls:  # no call after all: the whole text is content
            return text, ()
        parsed = self.parser.parse(text, final=True)
        return parsed.content, () if parsed.malformed else parsed.calls
