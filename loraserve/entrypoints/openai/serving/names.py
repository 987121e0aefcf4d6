"""What client-supplied names and paths may contain, checked before anything registers, logs or
counts them.

An adapter name (the load route's `lora_name`, a request's `model`) becomes a Prometheus label, a log
field and a string in every /v1/models answer; a `lora_path` is logged and opened. A lone surrogate
cannot be encoded as UTF-8 (one such name made /v1/models and /metrics fail for every client); a
newline or an escape sequence forges log lines or drives a terminal; a bidi override or a zero-width
character disguises a name. Such text is refused with a 400 that says what is wrong and where, and
never echoes the text itself.

Names that look alike are one name or refused (`canonical_name`, `confusable_key`): every adapter
name is NFKC-normalised where it enters (so NFC and NFD `café`, fullwidth `ｓｑｌ` and `sql` are the
same name), and two names whose skeletons are equal (Cyrillic `ѕql` and `sql`) cannot both be
registered. The skeleton is NFKC, then NFD, then `_LOOK_ALIKES`: the Cyrillic and Greek letters
drawn like a Latin letter. Its scope is that table, not Unicode's full confusables list (no
Latin-internal pairs such as `l`/`I`/`1` or `rn`/`m`, which ASCII names may legitimately differ by,
nor other scripts).
"""

from __future__ import annotations

import unicodedata
from http import HTTPStatus

from loraserve.entrypoints.openai.serving.errors import APIError

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
# Cyrillic and Greek letters drawn like a Latin letter, mapped to it (after NFD, so accented forms
# such as Cyrillic `ё` map too).
_LOOK_ALIKES = str.maketrans(
    # Cyrillic: а е о р с у х ѕ і ј ԁ ԛ ԝ һ ӏ, then А В Е К М Н О Р С Т Х У Ѕ І Ј Ү Һ Ӏ Ԛ Ԝ
    "\u0430\u0435\u043e\u0440\u0441\u0443\u0445\u0455\u0456\u0458\u0501\u051b\u051d\u04bb\u04cf"
    "\u0410\u0412\u0415\u041a\u041c\u041d\u041e\u0420\u0421\u0422\u0425\u0423\u0405\u0406\u0408"
    "\u04ae\u04ba\u04c0\u051a\u051c"
    # Greek: α γ ι ν ο ρ υ, then Α Β Ε Ζ Η Ι Κ Μ Ν Ο Ρ Τ Υ Χ
    "\u03b1\u03b3\u03b9\u03bd\u03bf\u03c1\u03c5"
    "\u0391\u0392\u0395\u0396\u0397\u0399\u039a\u039c\u039d\u039f\u03a1\u03a4\u03a5\u03a7",
    "aeopcyxsijdqwhlABEKMHOPCTXYSIJYHIQWayivopuABEZHIKMNOPTYX",
)


def check_name(value: str, param: str) -> None:
    """APIError 400 unless `value` is a clean name of at most MAX_NAME_CHARS characters."""
    _check(value, param, MAX_NAME_CHARS)


def canonical_name(value: str) -> str:
    """The name `value` stands for: its NFKC form (which `check_name` then checks: NFKC can lengthen)."""
    return value if value.isascii() else unicodedata.normalize("NFKC", value)


def confusable_key(value: str) -> str:
    """Equal for names that look alike: NFKC, then NFD with the look-alike letters mapped to Latin."""
    if value.isascii():
        return value
    return unicodedata.normalize("NFD", unicodedata.normalize("NFKC", value)).translate(_LOOK_ALIKES)


def checked_name(value: str, param: str) -> str:
    """The canonical form of client name `value`: checked (`check_name`), NFKC-normalised and
    stripped, then checked again (NFKC can lengthen a name or turn a character into a space)."""
    check_name(value, param)
    canonical = canonical_name(value).strip()
    if canonical != value:
        check_name(canonical, param)
    if not canonical:
        raise APIError(f"'{param}' must not be empty.", HTTPStatus.BAD_REQUEST, param)
    return canonical


def check_path(value: str, param: str) -> None:
    """APIError 400 unless `value` is a clean path of at most MAX_PATH_CHARS characters."""
    _check(value, param, MAX_PATH_CHARS)


def _check(value: str, param: str, max_chars: int) -> None:
    if len(value) > max_chars:
        raise APIError(
            f"'{param}' is too long: {len(value)} characters, at most {max_chars}.",
            HTTPStatus.BAD_REQUEST,
            param,
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
