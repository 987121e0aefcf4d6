"""DeclaredCalls: a model family's parser with its calls kept to the functions the request declared.

A model may write a call to a function the request's `tools` never named (a hallucinated or injected
name); the client has no such function to run. Under tool_choice "auto" such calls are dropped: a
call is judged once its whole name is read (a stream never sends a call before that), and an output
whose calls are all undeclared is plain content, as when a call does not parse (vLLM's fallback).
"""

from __future__ import annotations

import logging

from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ExtractedToolCalls,
    ParsedOutput,
    ToolParser,
)

logger = logging.getLogger(__name__)


class DeclaredCalls(ToolParser):
    def __init__(self, inner: ToolParser, declared: frozenset[str]) -> None:
        super().__init__(inner.tokenizer)
        self.inner = inner
        self.declared = declared
        self.skip_special_tokens = inner.skip_special_tokens

    def parse(self, text: str, final: bool) -> ParsedOutput:
        parsed = self.inner.parse(text, final)
        calls = tuple(call for call in parsed.calls if call.name is None or call.name in self.declared)
        if len(calls) == len(parsed.calls):
            return parsed
        return ParsedOutput(parsed.content, calls, parsed.malformed)

    def extract_tool_calls(self, text: str) -> ExtractedToolCalls:
        extracted = self.inner.extract_tool_calls(text)
        kept = [call for call in extracted.calls if call.name in self.declared]
        if len(kept) == len(extracted.calls):
            return extracted
        dropped = sorted({call.name for call in extracted.calls} - self.declared)
        logger.info(
            "Dropped tool calls to functions the request did not declare: %s", [n[:64] for n in dropped]
        )
        if not kept:
            return ExtractedToolCalls(text)  # no call left: the output is content
        return ExtractedToolCalls(extracted.content, kept)
