"""hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, repeated (Hermes 2 Pro, Qwen2.5,
SmolLM). Content is the text before the first call, as vLLM's parser returns it."""

from __future__ import annotations

from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    PartialToolCall,
    ToolParser,
    content_before,
)
from loraserve.entrypoints.openai.tool_parsers.json_scan import ScanError, scan_call, skip_ws
from loraserve.entrypoints.openai.tool_parsers.manager import ToolParserManager

START, END = "<tool_call>", "</tool_call>"


@ToolParserManager.register_module("hermes")
class HermesToolParser(ToolParser):
    skip_special_tokens = False  # Hermes 2 Pro's <tool_call> is a special token

    def parse(self, text: str, final: bool) -> ParsedOutput:
        content, position = content_before(text, START, final)
        calls: list[PartialToolCall] = []
        resumed = self.resumed(text) if position >= 0 else None
        if resumed is not None:
            position, calls = text.find(START, resumed[0]), resumed[1]
        while position >= 0:
            i = skip_ws(text, position + len(START))
            if i >= len(text):
                calls.append(PartialToolCall(None))
                break
            try:
                call, end = scan_call(text, i, final)
            except ScanError:
                return ParsedOutput(content, tuple(calls), malformed=True)
            calls.append(call)
            if end is None:
                break
            j = skip_ws(text, end)
            if text.startswith(END, j):
                j += len(END)
            elif j < len(text) and not END.startswith(text[j:]):
                return ParsedOutput(content, tuple(calls), malformed=True)
            else:
                break  # the closing tag is not whole yet
            self.remember(text, j, calls)
            position = text.find(START, j)
        return ParsedOutput(content, tuple(calls))
