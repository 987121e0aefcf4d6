"""What client-supplied names and paths may contain, checked before anything registers, logs or
counts them.

An adapter name (the load route's `lora_name`, a request's `model`) becomes a Prometheus label, a log
field and a string in every /v1/models answer; a `lora_path` is logged and opened. A lone surrogate
cannot be encoded as UTF-8 (one such name made /v1/models and /metrics fail for every client); a
newline or an escape sequence forges log lines or drives a terminal; a bidi override or a zero-width
character disguises a name. Such text is refused with a 400 that says what is wrong and where, and
never echoes the text itself.
"""

from __future__ import annotations

import unicodedata
from http import HTTPStatus

from loraserve.entrypoints.openai.errors import APIError

MAX_NAME_CHARS = 256
MAX_PATH_CHARS = 4096  # PATH_MAX on Linux; a longer path cannot name a file anyway
# Unicode categories refused: control (C0, DEL, C1), format (bidi overrides, zero-width, BOM),
# surrogates, and the line and paragraph separators some log viewers break lines at.
_REFUSED = {
    "Cc": "a control character",
    "Cf": "an invisible formatting character",
    "Cs": "a lone surrogate",
    "Zl": "a line separator",
    "Zp": "a paragraph separator",
}


def check_name(value: str, param: str) -> None:
    """APIError 400 unless `value` is a clean name of at most MAX_NAME_CHARS characters."""
    _check(value, param, MAX_NAME_CHARS)


def check_path(value: str, param: str) -> None:
    """APIError 400 unless `value` is a clean path of at most MAX_PATH_CHARS characters."""
    _check(value, param, MAX_PATH_CHARS)


def _check(value: str, param: str, max_chars: int) -> None:
    if len(value) > max_chars:
        raise APIError(
            f"'{param}' is too long: {len(value)} characters, at most {max_chars}.", HTTPStatus.BAD_REQUEST, param
        )
    if value.isascii() and value.isprintable():  # the common case, without a per-character lookup
        return
    for position, char in enumerate(value):
        kind = _REFUSED.get(unicodedata.category(char))
        if kind is not None:
            raise APIError(
                f"'{param}' contains {kind} (U+{ord(char):04X}) at position {position}; names and paths "
                "must be printable text.",
                HTTPStatus.BAD_REQUEST,
                param,
            )
