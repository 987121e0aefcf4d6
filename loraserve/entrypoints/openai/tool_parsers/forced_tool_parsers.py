"""The outputs of `tool_choice` "required" and a named function, which a grammar wrote (not a model
family's format), read as vLLM reads them: "required" is a JSON array of `{"name": ...,
"parameters": {...}}`; a named function's output is its arguments object alone. Not registered:
the serving layer picks them by tool_choice.
"""

from __future__ import annotations

from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    PartialToolCall,
    ToolParser,
)
from loraserve.entrypoints.openai.tool_parsers.json_scan import (
    ScanError,
    scan_call_list,
    skip_ws,
    spaced_json,
)


class RequiredToolParser(ToolParser):
    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if i >= len(text):
            return ParsedOutput("")
        try:
            if text[i] != "[":
                raise ScanError("not a list")
            calls, end = scan_call_list(text, i, final, ("parameters", "arguments"), memo=self)
        except ScanError:
            return ParsedOutput("", (), malformed=True)
        malformed = end is not None and skip_ws(text, end) < len(text)
        return ParsedOutput("", tuple(calls), malformed=malformed)


class NamedToolParser(ToolParser):
    def __init__(self, name: str, tokenizer: object = None) -> None:
        super().__init__(tokenizer)
        self.name = name

    def parse(self, text: str, final: bool) -> ParsedOutput:
        return ParsedOutput("", (PartialToolCall(self.name, spaced_json(text), final),))
