"""pythonic: a Python list of calls, `[get_weather(city="Paris"), now()]` (Llama 3.2 / 4, ToolACE),
`<|python_start|>` / `<|python_end|>` around it optional. Each call is read with `ast` (keyword
arguments whose values are literals), never evaluated; a text that is not such a list is content.

A stream names a call once `name(` is written and sends its arguments whole once the call closes
(a keyword's value is only known as JSON when it is complete).
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import (
    ParsedOutput,
    PartialToolCall,
    ToolParser,
)
from loraserve.entrypoints.openai.tool_parsers.json_scan import skip_ws
from loraserve.entrypoints.openai.tool_parsers.manager import ToolParserManager

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"\s*([A-Za-z_][\w.]*)\s*\(")
_CLOSE = {")": "(", "]": "[", "}": "{"}


class _Malformed(ValueError):
    pass


@ToolParserManager.register_module("pythonic")
class PythonicToolParser(ToolParser):
    skip_special_tokens = False  # Llama 4's <|python_start|>

    def parse(self, text: str, final: bool) -> ParsedOutput:
        i = skip_ws(text, 0)
        if text.startswith(START, i):
            i = skip_ws(text, i + len(START))
        rest = text[i:]
        if not rest.startswith("["):
            if not final and START.startswith(rest):
                return ParsedOutput("")
            return ParsedOutput(text)
        try:
            calls, end = _scan_list(text, i, self)
            if end is not None:
                tail = text[end:].strip()
                if tail and tail != END and not (not final and END.startswith(tail)):
                    raise _Malformed("text after the list")
            elif final:
                raise _Malformed("the list is not closed")
        except _Malformed:
            return ParsedOutput("", (), malformed=True)
        return ParsedOutput("", tuple(calls))


def _scan_list(text: str, i: int, memo: ToolParser) -> tuple[list[PartialToolCall], int | None]:
    """The calls of the list at text[i] == "[" (whole ones parsed) and the list's end, if closed;
    resumed after the whole calls an earlier parse of a prefix read."""
    calls: list[PartialToolCall] = []
    stack: list[str] = []
    start = i + 1
    j = i
    resumed = memo.resumed(text)
    if resumed is not None and resumed[0] > i:
        (start, calls), stack, j = resumed, ["["], resumed[0]
    while j < len(text):
        char = text[j]
        if char in "'\"":
            end = _string_end(text, j)
            if end is None:
                break
            j = end
            continue
        if char in "([{":
            stack.append(char)
        elif char in ")]}":
            if not stack or stack.pop() != _CLOSE[char]:
                raise _Malformed(f"unbalanced {char!r}")
            if not stack:  # the list closed
                element = text[start:j]
                if element.strip():
                    calls.append(_call(element))
                return calls, j + 1
        elif char == "," and len(stack) == 1:
            calls.append(_call(text[start:j]))
            start = j + 1
            memo.remember(text, start, calls)
        j += 1
    element = text[start:]
    match = _NAME.match(element)
    if match is not None:
        calls.append(PartialToolCall(match[1]))
    elif element.strip() and not re.fullmatch(r"\s*[A-Za-z_][\w.]*\s*", element):
        raise _Malformed("not a call")
    return calls, None


def _string_end(text: str, i: int) -> int | None:
    quote, j = text[i], i + 1
    while j < len(text):
        if text[j] == "\\":
            j += 2
            continue
        if text[j] == quote:
            return j + 1
        j += 1
    return None


def _call(element: str) -> PartialToolCall:
    """One whole call `name(key=literal, ...)` as a finished call with JSON arguments."""
    try:
        node = ast.parse(element.strip(), mode="eval").body
    except (SyntaxError, ValueError, MemoryError, RecursionError) as exc:
        raise _Malformed(str(exc)) from exc
    if not isinstance(node, ast.Call) or node.args:
        raise _Malformed("not a call with keyword arguments")
    arguments: dict[str, Any] = {}
    for keyword in node.keywords:
        if keyword.arg is None:
            raise _Malformed("**kwargs")
        try:
            arguments[keyword.arg] = ast.literal_eval(keyword.value)
        except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError) as exc:
            raise _Malformed(f"{keyword.arg} is not a literal") from exc
    try:
        text = json.dumps(arguments, ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:  # sets, bytes, complex numbers
        raise _Malformed(str(exc)) from exc
    return PartialToolCall(_dotted(node.func), text, True)


def _dotted(node: ast.expr) -> str:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return f"{_dotted(node.value)}.{node.attr}"
    raise _Malformed("a call's function is not a name")
