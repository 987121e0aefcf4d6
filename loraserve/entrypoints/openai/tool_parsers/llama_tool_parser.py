"""llama3_json: Llama 3.1/3.2's JSON calls, `<|python_tag|>` optional, objects `{"name": ...,
"parameters" | "arguments": {...}}` separated by ';'. A text that starts otherwise is content."""

from __future__ import annotations

from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    PartialToolCall,
    ToolParser,
)
from loraserve.entrypoints.openai.tool_parsers.json_scan import ScanError, scan_call, skip_ws
from loraserve.entrypoints.openai.tool_parsers.manager import ToolParserManager

BOT = "<|python_tag|>"


@ToolParserManager.register_module("llama3_json")
class Llama3JsonToolParser(ToolParser):
    skip_special_tokens = False  # <|python_tag|> is a special token

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        rest = text[i:]
        if rest.startswith(BOT):
            i = skip_ws(text, i + len(BOT))
        elif not rest.startswith("{"):
            if not final and BOT.startswith(rest):  # "" or a part of the tag: not decided yet
                return ParsedOutput("")
            return ParsedOutput(text)
        calls: list[PartialToolCall] = []
        resumed = self.resumed(text)
        if resumed is not None and resumed[0] > i:
            i, calls = skip_ws(text, resumed[0]), resumed[1]
        while i < len(text):
            try:
                if text[i] != "{":
                    raise ScanError(f"expected an object at {i}")
                call, end = scan_call(text, i, final)
            except ScanError:
                return ParsedOutput("", tuple(calls), malformed=True)
            calls.append(call)
            if end is None:
                break
            j = skip_ws(text, end)
            if j < len(text) and text[j] != ";":
                return ParsedOutput("", tuple(calls), malformed=True)
            if j >= len(text):
                break
            i = skip_ws(text, j + 1)
            self.remember(text, j + 1, calls)
        return ParsedOutput("", tuple(calls))
