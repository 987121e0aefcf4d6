"""Reading JSON tool calls as far as they are written: where a value ends, and the name and arguments
of a `{"name": ..., "arguments" | "parameters": {...}}` object, from a text that may stop anywhere.

Only the extent of values is scanned here (strings, escapes, nesting); the arguments are checked as
JSON by `json.loads` once whole. A character the format cannot hold raises `ScanError`.
"""

from __future__ import annotations

import json
import re

from loraserve.entrypoints.openai.tool_parsers.abstract_tool_parser import PartialToolCall, ToolParser

ARGUMENT_KEYS = ("arguments", "parameters")
_WHITESPACE = " \t\n\r"
_SCALAR = frozenset("0123456789+-.eEtruefalsn")
# Scanning runs on every streaming step over the whole text so far: the regexes keep it in C.
_STRING_BODY = re.compile(r'(?:[^"\\]|\\.)*', re.DOTALL)  # a string's characters after its quote
_STRUCTURE = re.compile(r'["{}\[\]]')
_LAYOUT = re.compile(r'("(?:[^"\\]|\\.)*"?)|([,:])|[ \t\n\r]+', re.DOTALL)
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"?', re.DOTALL)
_CONTROL = re.compile(r"[\x00-\x1f]")
_ESCAPES = {"\b": "\\b", "\f": "\\f", "\n": "\\n", "\r": "\\r", "\t": "\\t"}


class ScanError(ValueError):
    pass


def spaced_json(text: str) -> str:
    """JSON text (whole or cut anywhere) in json.dumps' layout: no whitespace outside strings, one space
    after each ',' and ':', control characters in strings escaped (a grammar's string rule, xgrammar's
    as vLLM's, admits them raw; strict JSON parsers such as the clients' refuse them). Each character's
    output depends only on what precedes it, so the result for a prefix is a prefix of the result for
    the whole: a stream sends the same arguments, in pieces, that the finished output holds (as compact
    as vLLM's `json.dumps`, whatever whitespace the model or a grammar allowing any whitespace wrote)."""
    return _LAYOUT.sub(_layout, text)


def _layout(match: re.Match[str]) -> str:
    if match[1] is not None:  # a string (or the start of one), as written but for control characters
        return _CONTROL.sub(_escape, match[1])
    return match[2] + " " if match[2] else ""


def escaped_controls(text: str) -> str:
    """JSON text (whole or cut anywhere) with the control characters inside its strings escaped and
    nothing else changed: what strict parsers read, with the value a lenient one reads. Prefix-stable,
    as `spaced_json`."""
    return _STRING.sub(lambda match: _CONTROL.sub(_escape, match[0]), text)


def _escape(match: re.Match[str]) -> str:
    char = match[0]
    return _ESCAPES.get(char) or f"\\u{ord(char):04x}"


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


def value_end(text: str, i: int, final: bool) -> int | None:
    """End of the JSON value starting at `i`; None when the text stops inside it."""
    if i >= len(text):
        return None
    char = text[i]
    if char == '"':
        return _string_end(text, i)
    if char in "{[":
        return _nested_end(text, i)
    if char in _SCALAR:
        j = i
        while j < len(text) and text[j] in _SCALAR:
            j += 1
        return j if j < len(text) or final else None
    raise ScanError(f"unexpected {char!r} at {i}")


def _string_end(text: str, i: int) -> int | None:
    """End of the string whose quote is at text[i]; None when the text stops inside it."""
    match = _STRING_BODY.match(text, i + 1)  # never None: the body may be empty
    j = match.end() if match is not None else i + 1
    return j + 1 if j < len(text) and text[j] == '"' else None


def _nested_end(text: str, i: int) -> int | None:
    depth = 0
    match = _STRUCTURE.search(text, i)
    while match is not None:
        j = match.start()
        if text[j] == '"':
            end = _string_end(text, j)
            if end is None:
                return None
            match = _STRUCTURE.search(text, end)
            continue
        depth += 1 if text[j] in "{[" else -1
        if depth == 0:
            return j + 1
        match = _STRUCTURE.search(text, j + 1)
    return None


def scan_call(
    text: str, i: int, final: bool, keys: tuple[str, ...] = ARGUMENT_KEYS
) -> tuple[PartialToolCall, int | None]:
    """The call object starting at `i` (text[i] == "{") and its end (None: not closed yet)."""
    if text[i] != "{":
        raise ScanError(f"expected an object at {i}")
    name: str | None = None
    arguments: str | None = None
    j = i + 1
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            break
        if text[j] == "}":
            return PartialToolCall(name, arguments or "{}", True), j + 1
        if text[j] != '"':
            raise ScanError(f"expected a key at {j}, got {text[j]!r}")
        key_end = _string_end(text, j)
        if key_end is None:
            break
        key = json.loads(text[j:key_end])
        j = skip_ws(text, key_end)
        if j >= len(text):
            break
        if text[j] != ":":
            raise ScanError(f"expected ':' at {j}")
        j = skip_ws(text, j + 1)
        end = value_end(text, j, final)
        if key in keys and arguments is None:
            arguments = spaced_json(text[j:] if end is None else text[j:end])
        elif key == "name" and end is not None:
            if text[j] != '"':  # only a string names a function (and an array may nest past decoding)
                raise ScanError("a call's name is not a string")
            value = json.loads(text[j:end])
            if not isinstance(value, str):
                raise ScanError("a call's name is not a string")
            name = value
        if end is None:
            break
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j += 1
        elif j < len(text) and text[j] != "}":
            raise ScanError(f"expected ',' or '}}' at {j}")
    return PartialToolCall(name, arguments or ""), None


def scan_call_list(
    text: str,
    i: int,
    final: bool,
    keys: tuple[str, ...] = ARGUMENT_KEYS,
    memo: ToolParser | None = None,
) -> tuple[list[PartialToolCall], int | None]:
    """The calls of a JSON array of call objects starting at `i` (text[i] == "["), and its end;
    `memo` (the parser) resumes after the whole calls an earlier parse of a prefix read."""
    calls: list[PartialToolCall] = []
    j = i + 1
    resumed = memo.resumed(text) if memo is not None else None
    if resumed is not None and resumed[0] > i:
        j, calls = resumed
    while True:
        j = skip_ws(text, j)
        if j >= len(text):
            return calls, None
        if text[j] == "]" and (not calls or calls[-1].complete):
            return calls, j + 1
        call, end = scan_call(text, j, final, keys)
        calls.append(call)
        if end is None:
            return calls, None
        j = skip_ws(text, end)
        if j < len(text) and text[j] == ",":
            j += 1
            if memo is not None:
                memo.remember(text, j, calls)
        elif j < len(text) and text[j] != "]":
            raise ScanError(f"expected ',' or ']' at {j}")
