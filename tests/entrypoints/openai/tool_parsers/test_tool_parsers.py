"""Each built-in parser on canned model text: the calls and content of a finished output, text that
is not a call stays content, and a stream fed at every character boundary (and cut once at every
boundary) sends pieces that add up to exactly the finished output, in OpenAI's delta format."""

from __future__ import annotations

import itertools
import json
from typing import Any

import pytest

from loraserve.entrypoints.openai.tool_parsers import (
    ExtractedToolCalls,
    ToolCall,
    ToolCallStream,
    ToolParser,
    ToolParserManager,
)
from loraserve.entrypoints.openai.tool_parsers.forced_tool_parsers import NamedToolParser, RequiredToolParser

WEATHER = '{"city": "Paris, FR", "days": [1, 2], "note": "a } and \\" inside"}'
# parser -> [(model text, expected content, expected [(name, arguments as JSON values)])]
CASES: dict[str, list[tuple[str, str | None, list[tuple[str, Any]]]]] = {
    "hermes": [
        (
            f'Let me check.\n<tool_call>\n{{"name": "get_weather", "arguments": {WEATHER}}}\n</tool_call>',
            "Let me check.\n",
            [("get_weather", json.loads(WEATHER))],
        ),
        (
            '<tool_call>{"arguments": {"x": 1}, "name": "a"}</tool_call>\n<tool_call>{"name": "b", '
            '"arguments": {}}</tool_call>',
            None,
            [("a", {"x": 1}), ("b", {})],
        ),
        ('<tool_call>{"name": "now"}</tool_call>', None, [("now", {})]),
        ("No call here, only <tool text.", "No call here, only <tool text.", []),
        ('<tool_call>{"name": "a", "arguments": {"x": 1}}', None, [("a", {"x": 1})]),  # unclosed tag, as vLLM
        ('<tool_call>{"name": "a", "arguments": {"x": 1</tool_call>', "<same>", []),  # broken JSON
        ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "<same>", []),
    ],
    "llama3_json": [
        (
            f'<|python_tag|>{{"name": "get_weather", "parameters": {WEATHER}}}',
            None,
            [("get_weather", json.loads(WEATHER))],
        ),
        (
            '{"name": "a", "arguments": {"x": [1]}}; {"name": "b", "parameters": {}}',
            None,
            [("a", {"x": [1]}), ("b", {})],
        ),
        ("The answer is 42.", "The answer is 42.", []),
        ('{"answer": 42}', '{"answer": 42}', []),
        ('{"name": "a", "parameters": {"x": 1}} and more', "<same>", []),
    ],
    "mistral": [
        (
            f'[TOOL_CALLS] [{{"name": "get_weather", "arguments": {WEATHER}}}, {{"name": "b", "arguments": {{}}}}]',
            None,
            [("get_weather", json.loads(WEATHER)), ("b", {})],
        ),
        (
            'Checking. [TOOL_CALLS][{"name": "a", "arguments": {"q": "[x]"}}]',
            "Checking. ",
            [("a", {"q": "[x]"})],
        ),
        ("Just text with [TOOL brackets].", "Just text with [TOOL brackets].", []),
        ('[TOOL_CALLS] [{"name": "a", "arguments": {"q": 1}}] trailing', "<same>", []),
    ],
    "pythonic": [
        (
            "[get_weather(city=\"Paris, FR\", days=[1, 2], note='a ) and \\' inside'), now()]",
            None,
            [("get_weather", {"city": "Paris, FR", "days": [1, 2], "note": "a ) and ' inside"}), ("now", {})],
        ),
        (
            '<|python_start|>[tools.search(q={"a": None, "b": True})]<|python_end|>',
            None,
            [("tools.search", {"q": {"a": None, "b": True}})],
        ),
        ("A plain answer.", "A plain answer.", []),
        ("[1, 2, 3]", "<same>", []),
        ('[f(__import__("os").system("x"))]', "<same>", []),  # not a literal: never evaluated
        ("[f(x=1e999)]", "<same>", []),  # not JSON
        ("[f(x=1), g(y=2)] and text", "<same>", []),
    ],
}
FLAT = [(name, *case) for name, cases in CASES.items() for case in cases]


def _parser(name: str) -> ToolParser:
    return ToolParserManager.get_tool_parser(name)()


def _expected(
    text: str, content: str | None, calls: list[tuple[str, Any]]
) -> tuple[str | None, list[tuple[str, Any]]]:
    return (text if content == "<same>" else content), calls


@pytest.mark.parametrize(("name", "text", "content", "calls"), FLAT)
def test_extract(name: str, text: str, content: str | None, calls: list[tuple[str, Any]]) -> None:
    content, calls = _expected(text, content, calls)
    extracted = _parser(name).extract_tool_calls(text)
    assert extracted.content == (content if calls else text)
    assert [(c.name, json.loads(c.arguments)) for c in extracted.calls] == calls


def _run_stream(
    parser: ToolParser, pieces: list[str], max_calls: int | None = None
) -> tuple[str, list[dict[str, Any]]]:
    """Feed the growing text; (content, calls as the OpenAI client accumulates them), checking the
    delta format on the way."""
    ids = (f"chatcmpl-tool-{i}" for i in itertools.count())
    stream = ToolCallStream(parser, lambda: next(ids), max_calls)
    content, calls = "", []
    text = ""
    for i, piece in enumerate(pieces):
        text += piece
        for delta in stream.update(text, final=i == len(pieces) - 1):
            assert (delta.content is None) != (delta.tool_call is None)
            if delta.content is not None:
                assert delta.content
                content += delta.content
                continue
            call = delta.tool_call
            assert call is not None
            if call.index == len(calls):  # a call's first delta: id, name, arguments ""
                assert call.id and call.name and call.arguments == ""
                calls.append({"id": call.id, "name": call.name, "arguments": ""})
            else:
                assert call.index == len(calls) - 1 or call.index < len(calls)
                assert call.id is None and call.name is None and call.arguments
                calls[call.index]["arguments"] += call.arguments
    return content, calls


def _check_stream(parser: ToolParser, text: str, pieces: list[str]) -> None:
    final = parser.extract_tool_calls(text)
    content, calls = _run_stream(parser, pieces)
    assert len({c["id"] for c in calls}) == len(calls)
    if not final.tools_called and calls:
        # The text left the format after a call's name was sent: a stream cannot take it back; it
        # sent the content before the call and stops there.
        assert text.startswith(content)
        return
    assert content == (final.content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [(c.name, c.arguments) for c in final.calls]


@pytest.mark.parametrize(("name", "text", "content", "calls"), FLAT)
def test_stream_every_character(name: str, text: str, content: str | None, calls: Any) -> None:
    _check_stream(_parser(name), text, ["", *text, ""])


@pytest.mark.parametrize(("name", "text", "content", "calls"), FLAT)
def test_stream_cut_once_anywhere(name: str, text: str, content: str | None, calls: Any) -> None:
    for cut in range(len(text) + 1):
        _check_stream(_parser(name), text, [text[:cut], text[cut:]])


def test_stream_sends_names_before_arguments_end() -> None:
    """A JSON call's name goes out as soon as it is read, its arguments in pieces while written."""
    parser = _parser("hermes")
    stream = ToolCallStream(parser, lambda: "chatcmpl-tool-x")
    head = '<tool_call>{"name": "get_weather", "arguments": {"city": "Pa'
    deltas = stream.update(head, final=False)
    assert [d.tool_call for d in deltas if d.tool_call] and deltas[0].tool_call is not None
    assert deltas[0].tool_call.name == "get_weather"
    assert "".join(d.tool_call.arguments for d in deltas if d.tool_call) == '{"city": "Pa'
    more = stream.update(head + 'ris"}}</tool_call>', final=True)
    assert "".join(d.tool_call.arguments for d in more if d.tool_call) == 'ris"}'


def test_content_holds_back_a_partial_marker_only() -> None:
    parser = _parser("hermes")
    assert parser.parse("Hello <tool_ca", final=False).content == "Hello "
    assert parser.parse("Hello <tool_ca", final=True).content == "Hello <tool_ca"
    assert parser.parse("Hello <b>", final=False).content == "Hello <b>"


def test_parallel_tool_calls_false_streams_the_first_call_only() -> None:
    text = '<tool_call>{"name": "a", "arguments": {}}</tool_call><tool_call>{"name": "b", "arguments": {}}</tool_call>'
    _, calls = _run_stream(_parser("hermes"), list(text), max_calls=1)
    assert [c["name"] for c in calls] == ["a"]


def test_required_and_named_outputs() -> None:
    required = RequiredToolParser()
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {}}]'
    assert required.extract_tool_calls(text) == ExtractedToolCalls(
        None, [ToolCall("a", '{"x": 1}'), ToolCall("b", "{}")]
    )
    _check_stream(required, text, list(text))
    named = NamedToolParser("get_weather")
    assert named.extract_tool_calls(' {"city": "Paris"} ').calls == [
        ToolCall("get_weather", '{"city": "Paris"}')
    ]
    _check_stream(named, '{"city": "Paris"}', list('{"city": "Paris"}'))
    assert not named.extract_tool_calls('{"city": "Par').tools_called  # cut short: content


def test_registry_decorator_and_unknown_name() -> None:
    @ToolParserManager.register_module(["test_echo", "test_echo2"])
    class Echo(ToolParser):
        pass

    try:
        assert ToolParserManager.get_tool_parser("test_echo2") is Echo
        with pytest.raises(KeyError, match="not found"):
            ToolParserManager.get_tool_parser("no_such_parser")
        with pytest.raises(TypeError):
            ToolParserManager.register_module("bad")(dict)  # type: ignore[arg-type]
    finally:
        ToolParserManager.tool_parsers.pop("test_echo", None)
        ToolParserManager.tool_parsers.pop("test_echo2", None)


def test_arguments_take_json_dumps_layout_whatever_the_whitespace() -> None:
    """A grammar with any whitespace lets a model write `{\n "city" :"Paris" }`; the arguments read
    as json.dumps writes them, and a stream's pieces still add up to them."""
    text = '<tool_call>{"name": "f", "arguments": {\n  "city" :"Pa ris" ,\n "n": [ 1 ,2 ], "q": "a\\" b"\n}}</tool_call>'
    (call,) = _parser("hermes").extract_tool_calls(text).calls
    assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    assert json.loads(call.arguments) == {"city": "Pa ris", "n": [1, 2], "q": 'a" b'}
    _check_stream(_parser("hermes"), text, list(text))


def test_control_characters_in_argument_strings_are_escaped() -> None:
    """A grammar's string rule (xgrammar's) admits raw control characters, which clients' strict JSON
    parsers refuse: the arguments escape them (as json.dumps would), a stream's pieces included, and
    `escaped_controls` does the same to a JSON text without touching anything else."""
    from loraserve.entrypoints.openai.tool_parsers.json_scan import escaped_controls

    text = '<tool_call>{"name": "f", "arguments": {"city": "Pa\tris\x01", "n": "a\\"\nb"}}</tool_call>'
    (call,) = _parser("hermes").extract_tool_calls(text).calls
    assert json.loads(call.arguments) == {"city": "Pa\tris\x01", "n": 'a"\nb'}  # strict: no raw control
    assert call.arguments == json.dumps(json.loads(call.arguments), ensure_ascii=False)
    _check_stream(_parser("hermes"), text, list(text))
    raw = '{ "a" :"x\ty",\n "b": ["q\\"\x02"] }'
    assert escaped_controls(raw) == '{ "a" :"x\\ty",\n "b": ["q\\"\\u0002"] }'
    assert all(escaped_controls(raw).startswith(escaped_controls(raw[:i])) for i in range(len(raw)))


@pytest.mark.parametrize("name", ["hermes", "mistral", "llama3_json", "pythonic", "required"])
def test_a_stream_reads_each_finished_call_once(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each step re-parses the text, but resumes after the calls already whole: the work per step
    does not grow with the calls before it (counted in calls of the call readers, not timed)."""
    from loraserve.entrypoints.openai.tool_parsers import (
        hermes_tool_parser,
        json_scan,
        llama_tool_parser,
        pythonic_tool_parser,
    )

    one = {"name": "f", "arguments": {"x": [1, 2]}}
    texts = {
        "hermes": "".join(f"<tool_call>{json.dumps(one)}</tool_call>" for _ in range(40)),
        "mistral": "[TOOL_CALLS] " + json.dumps([one] * 40),
        "llama3_json": "; ".join([json.dumps(one)] * 40),
        "pythonic": "[" + ", ".join(["f(x=[1, 2])"] * 40) + "]",
        "required": json.dumps([{"name": "f", "parameters": {"x": [1, 2]}}] * 40),
    }
    counted = {"n": 0}

    def counting(real: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            counted["n"] += 1
            return real(*args, **kwargs)

        return wrapper

    for module in (hermes_tool_parser, llama_tool_parser, json_scan):
        monkeypatch.setattr(module, "scan_call", counting(module.scan_call))
    monkeypatch.setattr(pythonic_tool_parser, "_call", counting(pythonic_tool_parser._call))
    parser = RequiredToolParser() if name == "required" else _parser(name)
    text = texts[name]
    pieces = [text[k : k + 3] for k in range(0, len(text), 3)]
    _, calls = _run_stream(parser, pieces)
    assert len(calls) == 40
    assert counted["n"] <= len(pieces) + 2 * 40  # quadratic without resuming: ~ steps x calls / 2
