"""mistral: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (Mistral 7B v0.3, Mistral Nemo).
Content is the text before the marker."""

from __future__ import annotations

from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    ToolParser,
    content_before,
)
from loraserve.entrypoints.openai.tool_parsers.json_scan import ScanError, scan_call, scan_call_list, skip_ws
from loraserve.entrypoints.openai.tool_parsers.manager import ToolParserManager

MARKER = "[TOOL_CALLS]"


@ToolParserManager.register_module("mistral")
class MistralToolParser(ToolParser):
    skip_special_tokens = False  # [TOOL_CALLS] is a special token

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, position = content_before(text, MARKER, final)
        if position < 0:
            return ParsedOutput(content)
        i = skip_ws(text, position + len(MARKER))
        if i >= len(text):
            return ParsedOutput(content)
        try:
            if text[i] == "[":
                calls, end = scan_call_list(text, i, final, memo=self)
            else:  # one object without the list, as some fine-tunes write it
                call, end = scan_call(text, i, final)
                calls = [call]
        except ScanError:
            return ParsedOutput(content, (), malformed=True)
        if end is not None and skip_ws(text, end) < len(text):
            return ParsedOutput(content, tuple(calls), malformed=True)
        return ParsedOutput(content, tuple(calls))
