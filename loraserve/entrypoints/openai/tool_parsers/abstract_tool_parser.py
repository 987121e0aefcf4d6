"""ToolParser: how one model family writes tool calls in its text, and the types a parse returns.

A parser reads the text generated so far and says what it holds: the content outside the calls that
can no longer turn into a call, and each call as far as it is written (its name once the whole name
is read, its arguments' JSON text so far). The same `parse` serves a finished output (`final=True`)
and every streaming step, so a stream is the difference between two parses (`streaming.py`), never a
state machine of its own. Arguments are the model's own JSON text, cut at the end of the value: what a
stream sends is always a prefix of what the finished output holds.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from loraserve.json_limits import check_json_depth


@dataclass(frozen=True, slots=True)
class PartialToolCall:
    name: str | None  # None until the whole name has been read
    arguments: str = ""  # the arguments' JSON text so far (whole JSON once `complete`)
    complete: bool = False  # the call's text is closed


@dataclass(frozen=True, slots=True)
class ParsedOutput:
    content: str  # text outside calls that no further text can turn into a call
    calls: tuple[PartialToolCall, ...] = ()
    malformed: bool = False  # the text left the format: it is content, not calls


@dataclass(frozen=True, slots=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object, as text


@dataclass(frozen=True, slots=True)
class ExtractedToolCalls:
    content: str | None
    calls: list[ToolCall] = field(default_factory=list)

    @property
    def tools_called(self) -> bool:
        return bool(self.calls)


class ToolParser:
    """Base class of every parser, built-in or from a --tool-parser-plugin file."""

    # False where the format's markers are special tokens, which the detokenizer would drop
    # (vLLM's adjust_request does the same for these parsers).
    skip_special_tokens: bool = True

    # (text up to a point, that point, the calls wholly before it): a stream's next parse resumes
    # there instead of reading every finished call again (the text only grows; checked by prefix).
    _memo: tuple[str, int, tuple[PartialToolCall, ...]] | None = None

    def __init__(self, tokenizer: Any = None) -> None:
        self.tokenizer = tokenizer

    def resumed(self, text: str) -> tuple[int, list[PartialToolCall]] | None:
        """Where the last parse of a prefix of `text` left whole calls, and those calls."""
        memo = self._memo
        if memo is None or not text.startswith(memo[0]):
            return None
        return memo[1], list(memo[2])

    def remember(self, text: str, position: int, calls: list[PartialToolCall]) -> None:
        """Every call in `calls` is whole and ends before `position` in `text`."""
        self._memo = (text[:position], position, tuple(calls))

    def parse(self, text: str, final: bool) -> ParsedOutput:
        """What `text` holds; `final`: no more text follows."""
        raise NotImplementedError

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        """The calls of a finished output; unless every call is whole, valid JSON-object arguments,
        the whole text is content (vLLM's fallback when a call does not parse)."""
        parsed = self.parse(text, final=True)
        calls = []
        for call in parsed.calls:
            if parsed.malformed or not call.complete or not call.name or not is_json_object(call.arguments):
                return ExtractedToolCalls(text)
            calls.append(ToolCall(call.name, call.arguments))
        if not calls:
            return ExtractedToolCalls(text)
        return ExtractedToolCalls(parsed.content or None, calls)


def is_json_object(text: str) -> bool:
    # strict=False: a grammar's JSON string rule (xgrammar's, vLLM's too) admits raw control characters
    # other than newline and carriage return inside strings, which strict JSON escapes.
    try:
        check_json_depth(text, "The arguments")  # the model's text: it may nest past what decoding can
        return isinstance(json.loads(text, strict=False), dict)
    except ValueError:
        return False


def undecided_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that could be the start of `marker` (held back in a stream)."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


def content_before(text: str, marker: str, final: bool) -> tuple[str, int]:
    """(content before `marker`, the marker's position or -1); a stream holds back a partial marker."""
    position = text.find(marker)
    if position >= 0:
        return text[:position], position
    if final:
        return text, -1
    return text[: len(text) - undecided_suffix(text, marker)], -1
