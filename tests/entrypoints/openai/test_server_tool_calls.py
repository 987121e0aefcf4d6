"""Tool calling through the OpenAI client against live servers (tiny random Llama + a PEFT adapter).

- tool_choice "required" and a named function, written under a grammar: valid calls of the given
  tools (jsonschema), base and adapter, streamed and not, greedy and sampled, in one batch with
  unconstrained requests whose greedy outputs are those they give alone;
- "auto" with each built-in parser (--enable-auto-tool-choice --tool-call-parser NAME): the output is
  forced into the parser's format by a regex (a random model writes no calls of its own), and the
  server reads it into tool_calls, streamed and not;
- "none", tools and earlier calls and results through the chat template, and the 400s with vLLM's texts.
The --tool-parser-plugin path, from the command line, is in test_server_tool_parser_plugin.py.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import torch
from support.harness import RunningServer

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 5},
        "unit": {"type": "string", "enum": ["c", "f"]},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
    },
    "required": ["city", "unit", "days"],
}
TIME = {
    "type": "object",
    "properties": {"zone": {"type": "string", "enum": ["utc", "cet"]}},
    "required": ["zone"],
}
TOOLS = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather.", "parameters": WEATHER},
    },
    {"type": "function", "function": {"name": "get_time", "parameters": TIME}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": TIME}
MESSAGES = [{"role": "user", "content": "Weather in Paris?"}]
# A template that shows what it gets: the tools, earlier calls (arguments as objects) and tool results.
TEMPLATE = (
    "{% if tools %}<|system|>TOOLS={% for t in tools %}{{ t['type'] }}:{{ t['function']['name'] }} {% endfor %}"
    "</s>{% endif %}"
    "{% for m in messages %}<|{{ m['role'] }}|>"
    "{% if m['role'] == 'tool' %}[{{ m['tool_call_id'] }}]{% endif %}{{ m['content'] }}"
    "{% for c in m.get('tool_calls') or [] %}CALL {{ c['id'] }} {{ c['function']['name'] }} "
    "{{ c['function']['arguments'] | tojson }}{% endfor %}</s>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# What each parser's format looks like, forced by a regex: (regex, content before the calls).
FORMATS = {
    "hermes": (
        r'Sure\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}", "unit": "c", '
        r'"days": [1-7]\}\}</tool_call><tool_call>\{"name": "get_time", "arguments": \{"zone": "utc"\}\}'
        r"</tool_call>",
        "Sure. ",
    ),
    "llama3_json": (
        r'<\|python_tag\|>\{"name": "get_weather", "parameters": \{"city": "[a-z]{1,5}", "unit": "f", '
        r'"days": [1-7]\}\}; \{"name": "get_time", "parameters": \{"zone": "cet"\}\}',
        None,
    ),
    "mistral": (
        r'\[TOOL_CALLS\] \[\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}", "unit": "c", '
        r'"days": [1-7]\}\}, \{"name": "get_time", "arguments": \{"zone": "utc"\}\}\]',
        None,
    ),
    "pythonic": (
        r'\[get_weather\(city="[a-z]{1,5}", unit="f", days=[1-7]\), get_time\(zone="cet"\)\]',
        None,
    ),
}


def _engine(model_dir: str) -> Any:
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    return AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            device="cpu",
            max_model_len=256,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            kv_cache_memory_bytes=32 << 20,
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        )
    )


@pytest.fixture(scope="module")
def model_and_adapter(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter

    model_dir = tiny_model("llama")
    adapter = str(tmp_path_factory.mktemp("tools") / "sql")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_peft_adapter(base, adapter, 77, model_dir, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    return model_dir, adapter


def _serve(model_and_adapter: tuple[str, str], **frontend: Any) -> Iterator[RunningServer]:
    model_dir, adapter = model_and_adapter
    options = ServerOptions(
        served_model_names=["tiny"],
        lora_modules=[LoRAModulePath("sql", adapter)],
        frontend=FrontendOptions(chat_template=TEMPLATE, **frontend),
    )
    with RunningServer(_engine(model_dir), options) as running:
        yield running


@pytest.fixture(scope="module")
def server(model_and_adapter: tuple[str, str]) -> Iterator[RunningServer]:
    """No tool flags: "required", named and "none" need none."""
    yield from _serve(model_and_adapter)


@pytest.fixture(scope="module", params=sorted(FORMATS))
def parser_server(
    request: pytest.FixtureRequest, model_and_adapter: tuple[str, str]
) -> Iterator[tuple[str, RunningServer]]:
    for running in _serve(
        model_and_adapter,
        enable_auto_tool_choice=True,
        tool_call_parser=request.param,
        exclude_tools_when_tool_choice_none=True,
    ):
        yield request.param, running


def _client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)


async def _chat(client: openai.AsyncOpenAI, stream: bool, **kwargs: Any) -> dict[str, Any]:
    """One choice as {content, tool_calls: [{id, name, arguments}], finish_reason}; a stream is
    accumulated as the OpenAI client's users do, checking the delta format on the way."""
    kwargs.setdefault("messages", MESSAGES)
    result = await client.chat.completions.create(stream=stream, **kwargs)
    if not stream:
        choice = result.choices[0]
        calls = [
            {"id": c.id, "type": c.type, "name": c.function.name, "arguments": c.function.arguments}
            for c in choice.message.tool_calls or []
        ]
        return {"content": choice.message.content, "tool_calls": calls, "finish_reason": choice.finish_reason}
    content, calls, reason = None, [], None
    async for chunk in result:
        for choice in chunk.choices:
            delta = choice.delta
            if delta.content:
                content = (content or "") + delta.content
            for call in delta.tool_calls or []:
                if call.index == len(calls):  # a call's first delta: id, type, name, arguments ""
                    assert call.id and call.type == "function" and call.function.name, call
                    assert call.function.arguments == "", call
                    calls.append(
                        {"id": call.id, "type": call.type, "name": call.function.name, "arguments": ""}
                    )
                else:
                    assert call.id is None and call.function.name is None, call
                    calls[call.index]["arguments"] += call.function.arguments
            reason = choice.finish_reason or reason
    return {"content": content, "tool_calls": calls, "finish_reason": reason}


def _json(text: str) -> Any:
    return json.loads(text, strict=False)  # raw control characters: see abstract_tool_parser.is_json_object


def _valid_calls(result: dict[str, Any], names: set[str], at_most: int | None = None) -> None:
    calls = result["tool_calls"]
    assert calls and result["finish_reason"] == "tool_calls" and result["content"] is None, result
    assert at_most is None or len(calls) <= at_most, result
    for call in calls:
        assert call["type"] == "function" and re.fullmatch(r"chatcmpl-tool-[0-9a-f]{32}", call["id"]), call
        assert call["name"] in names, call
        jsonschema.validate(_json(call["arguments"]), SCHEMAS[call["name"]])
    assert len({c["id"] for c in calls}) == len(calls)


def test_required_and_named_calls_validate_in_one_mixed_batch(server: RunningServer) -> None:
    named = {"type": "function", "function": {"name": "get_time"}}
    jobs: list[tuple[dict[str, Any], set[str], int | None]] = []
    for i, model in enumerate(("tiny", "sql")):
        for stream in (False, True):
            for sampled in (False, True):
                temperature = {"temperature": 0.9, "seed": i} if sampled else {"temperature": 0.0}
                common = dict(model=model, tools=TOOLS, stream=stream, **temperature)
                # A random model under "required" alone repeats calls until max_tokens (the array has
                # no end of its own, in vLLM's schema too): parallel_tool_calls=false bounds it to one.
                jobs.append(
                    ({**common, "tool_choice": "required", "parallel_tool_calls": False}, set(SCHEMAS), 1)
                )
                jobs.append(({**common, "tool_choice": named}, {"get_time"}, 1))
    free = [
        dict(model=m, stream=False, temperature=0.0, max_tokens=24, extra_body={"ignore_eos": True})
        for m in ("tiny", "sql")
    ]

    async def main() -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
        client = _client(server)
        alone = [await _chat(client, **body) for body in free]
        mixed = await asyncio.gather(
            *(_chat(client, **body) for body, _, _ in jobs), *(_chat(client, **b) for b in free)
        )
        return alone, list(mixed)

    alone, mixed = asyncio.run(main())
    for (body, names, at_most), result in zip(jobs, mixed, strict=False):
        try:
            _valid_calls(result, names, at_most)
        except Exception as exc:
            raise AssertionError(f"{body}: {result}") from exc
    assert mixed[len(jobs) :] == alone
    assert all(not r["tool_calls"] and r["content"] for r in alone)


def test_streamed_calls_equal_the_whole_response(server: RunningServer) -> None:
    async def main() -> list[dict[str, Any]]:
        client = _client(server)
        out = []
        for model in ("tiny", "sql"):
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                body = dict(
                    model=model, tools=TOOLS, tool_choice=choice, temperature=0.0, parallel_tool_calls=False
                )
                out += [await _chat(client, False, **body), await _chat(client, True, **body)]
        return out

    results = asyncio.run(main())
    for whole, streamed in zip(results[::2], results[1::2], strict=True):
        strip = lambda r: [(c["name"], c["arguments"]) for c in r["tool_calls"]]  # noqa: E731 (ids differ)
        assert strip(whole) == strip(streamed) and whole["finish_reason"] == streamed["finish_reason"]


def test_auto_reads_each_parsers_format(parser_server: tuple[str, RunningServer]) -> None:
    name, server = parser_server
    regex, content = FORMATS[name]

    async def main() -> list[dict[str, Any]]:
        client = _client(server)
        return [
            await _chat(
                client,
                stream,
                model=model,
                tools=TOOLS,
                temperature=0.0,
                extra_body={"structured_outputs": {"regex": regex}},
            )
            for model in ("tiny", "sql")
            for stream in (False, True)
        ]

    results = asyncio.run(main())
    for result in results:
        assert result["content"] == content and result["finish_reason"] == "tool_calls", result
        assert [c["name"] for c in result["tool_calls"]] == ["get_weather", "get_time"], result
        for call in result["tool_calls"]:
            jsonschema.validate(_json(call["arguments"]), SCHEMAS[call["name"]])
    strip = lambda r: [(c["name"], _json(c["arguments"])) for c in r["tool_calls"]]  # noqa: E731
    assert strip(results[0]) == strip(results[1]) and strip(results[2]) == strip(results[3])
    # Text that is no call stays content, with tool_choice "auto" (the default with tools).
    plain = asyncio.run(
        _chat(
            _client(server), False, model="tiny", tools=TOOLS, max_tokens=8, extra_body={"ignore_eos": True}
        )
    )
    assert plain["tool_calls"] == [] and plain["content"] and plain["finish_reason"] == "length"


def _rendered(server: RunningServer, body: dict[str, Any]) -> str:
    reply = server.http.post("/tokenize", json={"model": "tiny", **body})
    assert reply.status_code == 200, reply.text
    return server.http.post("/detokenize", json={"model": "tiny", "tokens": reply.json()["tokens"]}).json()[
        "prompt"
    ]


def test_tools_and_tool_messages_go_through_the_template(server: RunningServer, tokenizer: Any) -> None:
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    text = _rendered(server, {"messages": history, "tools": TOOLS})
    expected = tokenizer.apply_chat_template(
        [
            {"role": "user", "content": MESSAGES[0]["content"]},
            {
                **history[1],
                "content": "",
                "tool_calls": [
                    {
                        **history[1]["tool_calls"][0],
                        "function": {"name": "get_weather", "arguments": {"city": "paris"}},
                    }
                ],
            },
            history[2],
        ],
        tools=TOOLS,
        chat_template=TEMPLATE,
        tokenize=False,
        add_generation_prompt=True,
    )
    assert tokenizer.decode(tokenizer.encode(expected, add_special_tokens=False)) == text
    assert (
        "TOOLS=function:get_weather function:get_time " in text
        and "CALL call_1 get_weather" in text
        and "[call_1]sunny" in text
    )
    # Chat completions render the same prompt and answer; "none" shows the tools but reads no calls.
    reply = asyncio.run(
        _chat(
            _client(server),
            False,
            model="sql",
            messages=history,
            tools=TOOLS,
            tool_choice="none",
            max_tokens=4,
        )
    )
    assert reply["tool_calls"] == [] and reply["finish_reason"] in ("stop", "length")
    assert "TOOLS=" not in _rendered(server, {"messages": MESSAGES})


def _prompt_tokens(server: RunningServer, **fields: Any) -> int:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 1, **fields}
    reply = server.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 200, reply.text
    return int(reply.json()["usage"]["prompt_tokens"])


def test_exclude_tools_when_tool_choice_none(
    server: RunningServer, parser_server: tuple[str, RunningServer]
) -> None:
    """The template shows the tools with tool_choice "none", unless the server has
    --exclude-tools-when-tool-choice-none (the parser servers do)."""
    bare = _prompt_tokens(server)
    assert _prompt_tokens(server, tools=TOOLS, tool_choice="none") > bare
    _, excluding = parser_server
    assert _prompt_tokens(excluding, tools=TOOLS, tool_choice="none") == bare
    assert _prompt_tokens(excluding, tools=TOOLS, tool_choice="auto") > bare


BAD: list[tuple[dict[str, Any], str, str | None]] = [
    (
        {"tools": TOOLS, "tool_choice": "auto"},
        '"auto" tool choice requires --enable-auto-tool-choice and --tool-call-parser to be set',
        "tool_choice",
    ),
    ({"tools": TOOLS}, '"auto" tool choice requires --enable-auto-tool-choice', "tool_choice"),
    ({"tool_choice": "required"}, "When using `tool_choice`, `tools` must be set.", "tool_choice"),
    (
        {"tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "When using `tool_choice`, `tools` must be set.",
        "tool_choice",
    ),
    (
        {"tools": TOOLS, "tool_choice": "always"},
        'Invalid value for `tool_choice`: always! Only named tools, "none", "auto" or "required" are supported.',
        "tool_choice",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "launch"}}},
        "The tool specified in `tool_choice` does not match any of the specified `tools`",
        "tool_choice",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function"}},
        "Invalid value for `function`: `None` in `tool_choice`!",
        "tool_choice",
    ),
    (
        {"tools": TOOLS, "tool_choice": {"type": "function", "function": {}}},
        "Expected field `name` in `function` in `tool_choice`!",
        "tool_choice",
    ),
    (
        {"tools": [{"type": "function", "function": {"parameters": TIME}}], "tool_choice": "none"},
        "tools.0.function.name: Field required",
        "tools.0.function.name",
    ),
    (
        {
            "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
            "tool_choice": "required",
        },
        "must be a JSON Schema of type 'object'",
        "tools.0.function.parameters",
    ),
    (
        {"tools": [{"type": "retrieval", "function": {"name": "f"}}], "tool_choice": "none"},
        "tools.0.type",
        "tools.0.type",
    ),
    (
        {"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}},
        "You can only either use constraints for structured outputs or tools, not both.",
        "tool_choice",
    ),
    (  # the grammar path's own refusal, as for response_format
        {
            "tools": [
                {
                    "type": "function",
                    "function": {
                        "name": "f",
                        "parameters": {
                            "type": "object",
                            "properties": {"n": {"type": "integer", "multipleOf": 3}},
                        },
                    },
                }
            ],
            "tool_choice": "required",
        },
        "The provided JSON schema contains features not supported by xgrammar.",
        None,
    ),
    (
        {
            "messages": [
                *MESSAGES,
                {
                    "role": "assistant",
                    "tool_calls": [{"id": "1", "function": {"name": "f", "arguments": "{oops"}}],
                },
            ]
        },
        "messages[1].tool_calls[0].function.arguments is not valid JSON",
        "messages",
    ),
]


@pytest.mark.parametrize(("fields", "message", "param"), BAD)
def test_bad_tool_requests_are_400s(
    server: RunningServer, fields: dict[str, Any], message: str, param: str | None
) -> None:
    body = {"model": "tiny", "messages": MESSAGES, "max_tokens": 4, **fields}
    reply = server.http.post("/v1/chat/completions", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and (param is None or error["param"] == param), error
    ok = server.http.post(
        "/v1/chat/completions", json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text


def test_required_with_no_tools_is_none(server: RunningServer) -> None:
    """OpenAI's rule, as vLLM keeps it: "required" with an empty tool list asks for no call."""
    reply = asyncio.run(
        _chat(_client(server), False, model="tiny", tools=[], tool_choice="required", max_tokens=3)
    )
    assert reply["tool_calls"] == [] and reply["content"] is not None
