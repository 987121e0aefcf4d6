"""The Responses API on the real engine (tiny random Llama, two PEFT adapters, xgrammar), through the
openai client: a `json_schema` text format and a forced function call (named and "required"), for
the base model, an adapter and a mix, streamed (`responses.stream()`) and not, all in one batch with
chat completions: every output, response or chat, equals its run alone and the stream assembles the
non-streamed object. A function-tool round trip (the call, then its output through
`previous_response_id`) renders and answers exactly as chat completions does for the same messages.
"""

from __future__ import annotations

import asyncio
import re
from collections.abc import Iterator
from typing import Any

import jsonschema
import openai
import pytest
import torch
from support.harness import RunningServer
from support.tool_calls import SCHEMAS, TEMPLATE, TOOLS, loose_json

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

FUNCTIONS = [{"type": "function", **tool["function"]} for tool in TOOLS]  # the Responses API's flat form
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6}, "rain": {"type": "boolean"}},
        "required": ["city", "rain"], "additionalProperties": False}  # fmt: skip
JSON_FORMAT = {"format": {"type": "json_schema", "name": "city", "schema": CITY, "strict": True}}
MODELS = ("tiny", "sql", "sql=0.5,mlp=0.5")
# OpenAI's event order: a message item (its part, text deltas, done events) or a function call item
# (argument deltas, done events), between the lifecycle events.
_MESSAGE = r"output_item\.added content_part\.added( output_text\.delta)* output_text\.done content_part\.done output_item\.done"
_CALL = (
    r"output_item\.added( function_call_arguments\.delta)* function_call_arguments\.done output_item\.done"
)
_EVENTS = rf"created in_progress( ({_MESSAGE}|{_CALL}))+ (completed|incomplete)"


@pytest.fixture(scope="module")
def server(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RunningServer]:
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    root = tmp_path_factory.mktemp("responses")
    paths = {}
    for seed, (name, targets) in enumerate(
        (("sql", ["q_proj", "v_proj"]), ("mlp", ["up_proj", "down_proj"]))
    ):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        paths[name] = str(root / name)
        save_peft_adapter(base, paths[name], 41 + seed, model_dir, r=8, lora_alpha=16, target_modules=targets)
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            device="cpu",
            max_model_len=256,
            enable_lora=True,
            max_loras=3,
            max_lora_rank=16,
            kv_cache_memory_bytes=32 << 20,
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True},
        )
    )
    options = ServerOptions(
        served_model_names=["tiny"],
        lora_modules=[LoRAModulePath(name, path) for name, path in paths.items()],
        frontend=FrontendOptions(
            chat_template=TEMPLATE, enable_auto_tool_choice=True, tool_call_parser="hermes"
        ),
    )
    with RunningServer(engine, options) as running:
        yield running


def _client(server: RunningServer) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=600)


def _shape(response: Any) -> dict[str, Any]:
    """A response without what differs between runs: ids, times, and the prompt tokens that the
    prefix cache held (whatever ran before)."""
    data = response.model_dump(mode="json", exclude_none=True, by_alias=True)
    cached = data["usage"]["input_tokens_details"].pop("cached_tokens")
    assert 0 <= cached < data["usage"]["input_tokens"]
    out = {k: v for k, v in data.items() if k not in ("id", "created_at", "completed_at")}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in data["output"]]
    return out


async def _respond(client: openai.AsyncOpenAI, stream: bool, **body: Any) -> dict[str, Any]:
    if not stream:
        return _shape(await client.responses.create(**body))
    async with client.responses.stream(**body) as events:
        seen = [event async for event in events]
        # A response cut by max_output_tokens ends with response.incomplete, which carries it (the
        # helper's get_final_response is for response.completed, as with OpenAI's own streams).
        final = (
            seen[-1].response if seen[-1].type == "response.incomplete" else await events.get_final_response()
        )
    assert [event.sequence_number for event in seen] == list(range(len(seen)))
    assert re.fullmatch(_EVENTS, " ".join(event.type.removeprefix("response.") for event in seen)), seen
    return _shape(final)


async def _chat(client: openai.AsyncOpenAI, model: str) -> str | None:
    reply = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": "Say something."}], max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    return reply.choices[0].message.content


def _jobs() -> list[dict[str, Any]]:
    named = {"type": "function", "name": "get_weather"}
    jobs = []
    for model in MODELS:
        for stream in (False, True):
            common = dict(model=model, input="Weather in Paris?", temperature=0.0, stream=stream)
            jobs.append({**common, "text": JSON_FORMAT})
            jobs.append({**common, "tools": FUNCTIONS, "tool_choice": named})
            jobs.append(
                {**common, "tools": FUNCTIONS, "tool_choice": "required", "parallel_tool_calls": False}
            )
    return jobs


def _check(job: dict[str, Any], result: dict[str, Any]) -> None:
    assert result["status"] == "completed", (job, result)
    [item] = result["output"]
    if "text" in job:
        assert item["type"] == "message" and item["status"] == "completed"
        jsonschema.validate(loose_json(item["content"][0]["text"]), CITY)
        assert result["text"]["format"]["schema"] == CITY
    else:
        assert item["type"] == "function_call" and item["status"] == "completed", result
        if job["tool_choice"] != "required":
            assert item["name"] == "get_weather"
        jsonschema.validate(loose_json(item["arguments"]), SCHEMAS[item["name"]])


def test_formats_and_forced_calls_in_one_batch_with_chat_equal_their_runs_alone(
    server: RunningServer,
) -> None:
    jobs = _jobs()

    async def main() -> tuple[list[Any], list[Any], list[Any], list[Any]]:
        client = _client(server)
        alone = [await _respond(client, job.pop("stream"), **job) for job in [dict(j) for j in jobs]]
        chats_alone = [await _chat(client, model) for model in MODELS]
        together = await asyncio.gather(
            *(_respond(client, job.pop("stream"), **job) for job in [dict(j) for j in jobs]),
            *(_chat(client, model) for model in MODELS),
        )
        return alone, chats_alone, list(together[: len(jobs)]), list(together[len(jobs) :])

    alone, chats_alone, together, chats = asyncio.run(main())
    for job, result in zip(jobs, alone, strict=True):
        _check(job, result)
    assert together == alone and chats == chats_alone and all(chats)
    for i in range(0, len(jobs), 6):  # streamed (the next three) == whole, per model
        assert alone[i : i + 3] == alone[i + 3 : i + 6]
    by_model = [alone[i]["output"] for i in range(0, len(jobs), 6)]
    assert by_model[0] != by_model[1] or by_model[1] != by_model[2]  # the adapter and the mix matter


def test_a_function_tool_round_trip_answers_as_chat_does(server: RunningServer) -> None:
    async def main() -> tuple[Any, Any, Any, Any]:
        client = _client(server)
        named = {"type": "function", "name": "get_time"}
        call = await client.responses.create(
            model="sql", input="What time is it?", tools=FUNCTIONS, tool_choice=named
        )
        [item] = call.output
        assert item.type == "function_call" and item.name == "get_time" and item.call_id.startswith("call_")
        result = [{"type": "function_call_output", "call_id": item.call_id, "output": "noon"}]
        follow = dict(model="sql", input=result, previous_response_id=call.id, tools=FUNCTIONS,
                      tool_choice="none", max_output_tokens=6, temperature=0.0)  # fmt: skip
        answer = await client.responses.create(**follow)
        assert answer.previous_response_id == call.id
        streamed = await _respond(client, True, **follow)
        again = await client.responses.create(**follow)  # the same prompt: its whole blocks are cached
        cached = again.usage.input_tokens_details.cached_tokens
        assert cached == (again.usage.input_tokens - 1) // 16 * 16 > 0, again.usage
        chat = await client.chat.completions.create(
            model="sql",
            messages=[
                {"role": "user", "content": "What time is it?"},
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": item.call_id,
                            "type": "function",
                            "function": {"name": "get_time", "arguments": item.arguments},
                        }
                    ],
                },  # fmt: skip
                {"role": "tool", "tool_call_id": item.call_id, "content": "noon"},
            ],
            tools=TOOLS,
            tool_choice="none",
            max_tokens=6,
            temperature=0.0,
        )
        return item, answer, streamed, chat

    item, answer, streamed, chat = asyncio.run(main())
    jsonschema.validate(loose_json(item.arguments), SCHEMAS["get_time"])
    assert answer.output_text == chat.choices[0].message.content and answer.output[0].type == "message"
    assert answer.usage.input_tokens == chat.usage.prompt_tokens
    assert answer.usage.output_tokens == chat.usage.completion_tokens
    assert streamed == _shape(answer)
