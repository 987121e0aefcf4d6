"""How deeply a JSON text nests, found before it is decoded.

`json.loads` recurses once per nesting level: a 1 MB adapter_config.json of 100k `[` raised
RecursionError (a 500), and where it fails depends on how deep the caller's stack already is. The
depth is counted first, on the bytes, in a few vectorised passes (strings blanked out, since a
bracket inside a string does not nest): milliseconds for the largest config, no recursion.
"""

from __future__ import annotations

import re

import numpy

# A JSON string: quotes around non-quote, non-backslash runs and escape pairs (linear, no backtracking).
_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STEP = numpy.zeros(256, dtype=numpy.int8)
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1


def json_depth(data: bytes) -> int:
    """The deepest nesting of arrays and objects in `data` (0 for a scalar). Brackets of an unterminated
    string count, so broken JSON may read deeper than it is; its decoding fails anyway."""
    blanked = _STRING.sub(b'""', data)
    steps = _STEP[numpy.frombuffer(blanked, dtype=numpy.uint8)]
    if steps.size == 0:
        return 0
    return max(int(numpy.cumsum(steps, dtype=numpy.int32).max()), 0)  # 1 MiB of "[" fits int32
