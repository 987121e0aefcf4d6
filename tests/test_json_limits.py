"""`json_limits`: the nesting of a JSON text, counted on its bytes before it is decoded, and the field it is too deep in."""

from __future__ import annotations

import json

import pytest

from loraserve.json_limits import deepest_member, json_depth


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


def test_the_deepest_member_is_named() -> None:
    deep = "[" * 100 + "]" * 100
    body = '{"model": "m", "note": "{[{[ \\" [[", "response_format": {"schema": ' + deep + '}, "n": 1}'
    assert json_depth(body) == 102
    assert deepest_member(body, 64) == "response_format"
    assert deepest_member(body, 200) is None
    assert deepest_member(deep, 64) is None  # not an object: no field to name


def test_loads_bounded_refuses_before_decoding() -> None:
    from loraserve.json_limits import JSONDepthError, loads_bounded, value_depth

    with pytest.raises(JSONDepthError, match="guided_json nests 100000 levels") as caught:
        loads_bounded("[" * 100_000 + "]" * 100_000, "guided_json", "guided_json")
    assert caught.value.parameter == "guided_json"
    assert loads_bounded('{"a": [1]}', "x") == {"a": [1]}
    assert value_depth({"a": [[{}]], "b": 1}) == 4
