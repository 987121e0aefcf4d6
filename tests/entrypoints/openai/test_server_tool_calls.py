"""Tool calling through the OpenAI client against live servers (tiny random Llama + a PEFT adapter).

- tool_choice "required" and a named function, written under a grammar: valid calls of the given
  tools (jsonschema), base and adapter, streamed and not, greedy and sampled, in one batch with
  unconstrained requests whose greedy outputs are those they give alone;
- "auto" with each built-in parser (--enable-auto-tool-choice --tool-call-parser NAME): the output is
  forced into the parser's format by a regex (a random model writes no calls of its own), and the
  server reads it into tool_calls, streamed and not;
- "none", tools and earlier calls and results through the chat template, and the 400s with vLLM's texts.
The tools, template, parser formats, refused requests and the chat client are in
tests/support/tool_calls.py; the --tool-parser-plugin path, from the command line, is in
test_server_tool_parser_plugin.py.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import jsonschema
import pytest
import torch
from support.harness import RunningServer
from support.tool_calls import (
    BAD_TOOL_REQUESTS,
    FORMATS,
    MESSAGES,
    SCHEMAS,
    TEMPLATE,
    TOOLS,
    chat_choice,
    check_calls,
    loose_json,
    openai_client,
    prompt_tokens,
    rendered_prompt,
    serve_with_tools,
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


@pytest.fixture(scope="module")
def server(model_and_adapter: tuple[str, str]) -> Iterator[RunningServer]:
    """No tool flags: "required", named and "none" need none."""
    yield from serve_with_tools(model_and_adapter)


@pytest.fixture(scope="module", params=sorted(FORMATS))
def parser_server(
    request: pytest.FixtureRequest, model_and_adapter: tuple[str, str]
) -> Iterator[tuple[str, RunningServer]]:
    for running in serve_with_tools(
        model_and_adapter,
        enable_auto_tool_choice=True,
        tool_call_parser=request.param,
        exclude_tools_when_tool_choice_none=True,
    ):
        yield request.param, running


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
        client = openai_client(server)
        alone = [await chat_choice(client, **body) for body in free]
        mixed = await asyncio.gather(
            *(chat_choice(client, **body) for body, _, _ in jobs), *(chat_choice(client, **b) for b in free)
        )
        return alone, list(mixed)

    alone, mixed = asyncio.run(main())
    for (body, names, at_most), result in zip(jobs, mixed, strict=False):
        try:
            check_calls(result, names, at_most)
        except Exception as exc:
            raise AssertionError(f"{body}: {result}") from exc
    assert mixed[len(jobs) :] == alone
    assert all(not r["tool_calls"] and r["content"] for r in alone)


def test_streamed_calls_equal_the_whole_response(server: RunningServer) -> None:
    async def main() -> list[dict[str, Any]]:
        client = openai_client(server)
        out = []
        for model in ("tiny", "sql"):
            for choice in ("required", {"type": "function", "function": {"name": "get_weather"}}):
                body = dict(
                    model=model, tools=TOOLS, tool_choice=choice, temperature=0.0, parallel_tool_calls=False
                )
                out += [await chat_choice(client, False, **body), await chat_choice(client, True, **body)]
        return out

    results = asyncio.run(main())
    for whole, streamed in zip(results[::2], results[1::2], strict=True):
        strip = lambda r: [(c["name"], c["arguments"]) for c in r["tool_calls"]]  # noqa: E731 (ids differ)
        assert strip(whole) == strip(streamed) and whole["finish_reason"] == streamed["finish_reason"]


def test_auto_reads_each_parsers_format(parser_server: tuple[str, RunningServer]) -> None:
    name, server = parser_server
    regex, content = FORMATS[name]

    async def main() -> list[dict[str, Any]]:
        client = openai_client(server)
        return [
            await chat_choice(
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
            jsonschema.validate(loose_json(call["arguments"]), SCHEMAS[call["name"]])
    strip = lambda r: [(c["name"], loose_json(c["arguments"])) for c in r["tool_calls"]]  # noqa: E731
    assert strip(results[0]) == strip(results[1]) and strip(results[2]) == strip(results[3])
    # Text that is no call stays content, with tool_choice "auto" (the default with tools).
    plain = asyncio.run(
        chat_choice(
            openai_client(server),
            False,
            model="tiny",
            tools=TOOLS,
            max_tokens=8,
            extra_body={"ignore_eos": True},
        )
    )
    assert plain["tool_calls"] == [] and plain["content"] and plain["finish_reason"] == "length"


def test_auto_drops_calls_to_undeclared_functions(parser_server: tuple[str, RunningServer]) -> None:
    """A hostile or hallucinating model calls a function the request never declared: the call is
    dropped, streamed or not; an output whose every call is undeclared is plain content."""
    name, server = parser_server
    regex, _ = FORMATS[name]
    one_undeclared = regex.replace("get_time", "rm_rf")
    all_undeclared = one_undeclared.replace("get_weather", "drop_db")

    async def main() -> list[dict[str, Any]]:
        client = openai_client(server)
        return [
            await chat_choice(
                client,
                stream,
                model="tiny",
                tools=TOOLS,
                temperature=0.0,
                extra_body={"structured_outputs": {"regex": forced}},
            )
            for forced in (one_undeclared, all_undeclared)
            for stream in (False, True)
        ]

    results = asyncio.run(main())
    for result in results[:2]:
        assert [c["name"] for c in result["tool_calls"]] == ["get_weather"], result
        assert result["finish_reason"] == "tool_calls"
    for result in results[2:]:
        assert result["tool_calls"] == [] and result["finish_reason"] == "stop", result
        assert "drop_db" in result["content"] and "rm_rf" in result["content"]


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
    text = rendered_prompt(server, {"messages": history, "tools": TOOLS})
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
        chat_choice(
            openai_client(server),
            False,
            model="sql",
            messages=history,
            tools=TOOLS,
            tool_choice="none",
            max_tokens=4,
        )
    )
    assert reply["tool_calls"] == [] and reply["finish_reason"] in ("stop", "length")
    assert "TOOLS=" not in rendered_prompt(server, {"messages": MESSAGES})


def test_exclude_tools_when_tool_choice_none(
    server: RunningServer, parser_server: tuple[str, RunningServer]
) -> None:
    """The template shows the tools with tool_choice "none", unless the server has
    --exclude-tools-when-tool-choice-none (the parser servers do)."""
    bare = prompt_tokens(server)
    assert prompt_tokens(server, tools=TOOLS, tool_choice="none") > bare
    _, excluding = parser_server
    assert prompt_tokens(excluding, tools=TOOLS, tool_choice="none") == bare
    assert prompt_tokens(excluding, tools=TOOLS, tool_choice="auto") > bare


@pytest.mark.parametrize(("fields", "message", "param"), BAD_TOOL_REQUESTS)
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
        chat_choice(
            openai_client(server), False, model="tiny", tools=[], tool_choice="required", max_tokens=3
        )
    )
    assert reply["tool_calls"] == [] and reply["content"] is not None
