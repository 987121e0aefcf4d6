"""`json_depth`: the nesting of a JSON text, counted on its bytes before it is decoded."""

from __future__ import annotations

import json

import pytest

from loraserve.lora.json_bounds import json_depth


@pytest.mark.parametrize(
    ("text", "depth"),
    [
        ("", 0),
        ("3", 0),
        ('"[[["', 0),
        ("{}", 1),
        ('{"a": [1, {"b": [2]}], "c": {}}', 4),
        ('{"a": "]]]]", "b": [[1]]}', 3),  # closing brackets in a string do not unnest
        ('{"a": "x\\"[[[", "b": 1}', 1),  # an escaped quote does not end the string
        ('{"a": "\\\\", "b": [[1]]}', 3),  # an escaped backslash does not escape the quote
        ("[" * 50_000 + "]" * 50_000, 50_000),
    ],
)
def test_depth(text: str, depth: int) -> None:
    assert json_depth(text.encode()) == depth


def test_agrees_with_the_decoded_value() -> None:
    value = {"r": 8, "rank_pattern": {"q[0]": 4}, "x": [[{"y": ["]", "[", {"z": "{"}]}]]}

    def depth(v: object) -> int:
        children = v.values() if isinstance(v, dict) else v if isinstance(v, list) else None
        return 0 if children is None else 1 + max((depth(c) for c in children), default=0)

    assert json_depth(json.dumps(value).encode()) == depth(value) == 6
