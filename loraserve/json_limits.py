"""One bound on how deeply JSON may nest, for every JSON the server parses: request bodies, JSON given
as strings inside requests (schemas, tool arguments, structural tags), adapter configs.

`json.loads` recurses once per nesting level, and so does every walk over the value afterwards (a
schema check, pydantic, xgrammar): 500 levels of `[` raised RecursionError deep in a request (a 500
with a thousand-line traceback), and where it fails depends on how deep the caller's stack already
is. The depth is counted first, on the bytes, in a few vectorised numpy passes (brackets inside
strings do not nest; escaped quotes do not end a string): milliseconds for a 4 MiB body, no
recursion. A text that nests deeper than `MAX_JSON_DEPTH` is refused with a `JSONDepthError` (a
ValueError, the client's 400) naming the field, before anything decodes it.
"""

from __future__ import annotations

import json
import re
from typing import Any

import numpy

# Real requests nest under 20 levels (a tool's parameter schema inside a chat body), adapter configs 3.
MAX_JSON_DEPTH = 64

_STEP = numpy.zeros(256, dtype=numpy.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_QUOTE, _BACKSLASH = ord('"'), ord("\\")
# A JSON string: quotes around non-quote, non-backslash runs and escape pairs (linear, no backtracking).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)


class JSONDepthError(ValueError):
    """A JSON text nests deeper than MAX_JSON_DEPTH (HTTP 400); `parameter` names the field."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


def _as_bytes(data: bytes | str) -> numpy.ndarray:
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    return numpy.frombuffer(raw, dtype=numpy.uint8)


def _string_quotes(chars: numpy.ndarray) -> numpy.ndarray:
    """Positions of the quotes that open or close a string: those preceded by an even run of
    backslashes."""
    quotes = numpy.flatnonzero(chars == _QUOTE)
    if quotes.size == 0:
        return quotes
    # For every position, the index of the last character at or before it that is not a backslash.
    index = numpy.arange(chars.size, dtype=numpy.int32)
    last_plain = numpy.maximum.accumulate(numpy.where(chars != _BACKSLASH, index, -1))
    before = quotes - 1
    run = numpy.where(before >= 0, before - last_plain[numpy.maximum(before, 0)], 0)
    return quotes[run % 2 == 0]


def _depths(chars: numpy.ndarray) -> numpy.ndarray:
    """The nesting depth after each byte, brackets inside strings not counted."""
    steps = _STEP[chars]
    quotes = _string_quotes(chars)
    if quotes.size:
        toggles = numpy.zeros(chars.size + 1, dtype=numpy.int8)
        toggles[quotes + 1] = 1  # inside a string from just after its opening quote to its closing one
        inside = (numpy.cumsum(toggles[:-1], dtype=numpy.int32) % 2).astype(bool)
        steps = numpy.where(inside, 0, steps)
    return numpy.cumsum(steps, dtype=numpy.int32)  # 2 GiB of "[" would not fit; bodies are MiB


def json_depth(data: bytes | str) -> int:
    """The deepest nesting of arrays and objects in `data` (0 for a scalar). Brackets of an unterminated
    string count, so broken JSON may read deeper than it is; its decoding fails anyway."""
    raw = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else data
    blanked = _STRING.sub(b'""', raw)  # one C pass; positions are not needed here
    if not blanked:
        return 0
    steps = _STEP[numpy.frombuffer(blanked, dtype=numpy.uint8)]
    return max(int(numpy.cumsum(steps, dtype=numpy.int32).max()), 0)


def deepest_member(data: bytes | str, limit: int = MAX_JSON_DEPTH) -> str | None:
    """The top-level key of a JSON object whose value first nests past `limit` (None: not an object,
    or no such key found)."""
    chars = _as_bytes(data)
    depths = _depths(chars)
    over = numpy.flatnonzero(depths > limit)
    if over.size == 0:
        return None
    quotes = _string_quotes(chars)
    opening = quotes[0::2]
    opening = opening[(opening < over[0]) & (depths[numpy.maximum(opening - 1, 0)] == 1)]
    raw = chars.tobytes()
    for start in opening[::-1][:64]:  # the key is the last string at depth 1 followed by ':'
        end_at = numpy.searchsorted(quotes, start, side="right")
        if end_at >= quotes.size:
            continue
        end = int(quotes[end_at])
        if raw[end + 1 : end + 64].lstrip().startswith(b":"):
            try:
                return str(json.loads(raw[start : end + 1]))
            except ValueError:
                return None
    return None


def check_json_depth(data: bytes | str, what: str, parameter: str | None = None) -> None:
    """JSONDepthError naming `what` (and the field) when `data` nests deeper than MAX_JSON_DEPTH."""
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise JSONDepthError(
            f"{what} nests {depth} levels deep; at most {MAX_JSON_DEPTH} levels of JSON arrays and "
            "objects are accepted.",
            parameter,
        )


def loads_bounded(text: str | bytes, what: str, parameter: str | None = None) -> Any:
    """`json.loads(text)` once its depth is known to be within MAX_JSON_DEPTH (JSONDepthError otherwise;
    json.JSONDecodeError for text that is not JSON)."""
    check_json_depth(text, what, parameter)
    return json.loads(text)


def value_depth(value: Any) -> int:
    """The nesting of a decoded value (dicts and lists), walked without recursion."""
    deepest = 0
    stack: list[tuple[Any, int]] = [(value, 0)]
    while stack:
        item, depth = stack.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        depth += 1
        deepest = max(deepest, depth)
        if depth <= MAX_JSON_DEPTH:  # deeper is refused anyway: no need to walk all of it
            stack.extend((child, depth) for child in children)
    return deepest
