"""The Responses API's surface through the openai client (fake engine, real server): a response is
the chat path's answer to the same conversation (same prompt, same tokens) for the base model, an
adapter and an adapter version; input items (messages with text parts, function calls and their
outputs) render as the equivalent chat messages; `responses.stream()` assembles exactly the
non-streamed object from OpenAI's event sequence; retrieval, `previous_response_id` chains, the
bounded store's eviction, background responses and their cancellation; every refusal is a 400 in
OpenAI's error shape naming what is not offered. Real tokens (json_schema, tool calls, mixed
batches) are test_server_responses_model.py's; the Agents SDK's loop test_server_responses_agents.py's.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from support.fake_engine import FakeEngine, hold_generation, release_generation
from support.harness import RunningServer, wait_for
from support.tool_calls import TEMPLATE, TOOLS

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

EOS_AFTER = 4  # the fake model "writes eos" after 4 tokens: responses complete
FUNCTION = {"type": "function", "name": "get_weather", "description": "Weather.", "parameters": TOOLS[0]["function"]["parameters"]}  # fmt: skip


def _serve(tokenizer: Any, adapter_dir: str, **options: Any) -> Iterator[RunningServer]:
    engine = FakeEngine(tokenizer, max_model_len=8192)
    engine.eos_after = EOS_AFTER
    server_options = ServerOptions(
        served_model_names=["base"],
        lora_modules=[LoRAModulePath("sql", adapter_dir)],
        frontend=FrontendOptions(chat_template=TEMPLATE),
        **options,
    )
    with RunningServer(engine, server_options) as running:
        yield running


@pytest.fixture(scope="module")
def server(tokenizer: Any, adapter_dir: str) -> Iterator[RunningServer]:
    yield from _serve(tokenizer, adapter_dir)


@pytest.fixture(scope="module")
def small_store(tokenizer: Any, adapter_dir: str) -> Iterator[RunningServer]:
    yield from _serve(tokenizer, adapter_dir, responses_store_max_responses=3, responses_store_max_bytes=6000)


def _client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)


def _shape(response: Any) -> dict[str, Any]:
    """A response without what differs between two runs of it (ids, times)."""
    data = (
        response
        if isinstance(response, dict)
        else response.model_dump(mode="json", exclude_none=True, by_alias=True)
    )
    drop = {"id", "created_at", "completed_at"}
    out = {k: v for k, v in data.items() if k not in drop}
    out["output"] = [{k: v for k, v in item.items() if k not in ("id", "call_id")} for item in data["output"]]
    return out


def _version(server: RunningServer) -> str:
    return server.http.get("/v1/models").json()["data"][1]["digest"][:8]


@pytest.mark.parametrize("model", ["base", "sql", "sql@version"])
def test_a_response_is_the_chat_answer_to_the_same_conversation(server: RunningServer, model: str) -> None:
    model = model.replace("version", _version(server)) if "@" in model else model
    client = _client(server)
    response = client.responses.create(model=model, instructions="Be brief.", input="Weather in Paris?")
    prompt = server.engine.prompts_seen[-1]
    chat = client.chat.completions.create(
        model=model,
        messages=[
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Weather in Paris?"},
        ],
    )
    assert server.engine.prompts_seen[-1] == prompt
    assert response.object == "response" and response.id.startswith("resp_") and response.model == model
    assert response.status == "completed" and response.error is None and response.incomplete_details is None
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert message.id.startswith("msg_") and [part.type for part in message.content] == ["output_text"]
    assert response.output_text == chat.choices[0].message.content and response.output_text
    usage = response.usage
    assert (usage.input_tokens, usage.output_tokens) == (chat.usage.prompt_tokens, EOS_AFTER)
    assert (
        usage.total_tokens == usage.input_tokens + EOS_AFTER and usage.input_tokens_details.cached_tokens == 0
    )
    assert usage.output_tokens_details.reasoning_tokens == 0


def test_max_output_tokens_makes_an_incomplete_response(server: RunningServer) -> None:
    response = _client(server).responses.create(model="sql", input="Hello", max_output_tokens=2)
    assert response.status == "incomplete" and response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete" and response.usage.output_tokens == 2
    assert response.max_output_tokens == 2


def test_input_items_render_as_the_equivalent_chat_messages(server: RunningServer) -> None:
    items = [
        {"role": "system", "content": [{"type": "input_text", "text": "Use tools."}]},
        {
            "type": "message",
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Weather "},
                {"type": "input_text", "text": "in Paris?"},
            ],
        },  # fmt: skip
        {
            "type": "message",
            "role": "assistant",
            "id": "msg_1",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Checking.", "annotations": []}],
        },  # fmt: skip
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "paris"}',
        },
        {"type": "function_call", "call_id": "call_2", "name": "get_time", "arguments": '{"zone": "cet"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        {
            "type": "function_call_output",
            "call_id": "call_2",
            "output": [{"type": "input_text", "text": "noon"}],
        },
    ]
    client = _client(server)
    client.responses.create(model="base", input=items, tools=[FUNCTION], tool_choice="none")
    prompt = server.engine.prompts_seen[-1]
    calls = [
        {
            "id": "call_1",
            "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "paris"}'},
        },
        {
            "id": "call_2",
            "type": "function",
            "function": {"name": "get_time", "arguments": '{"zone": "cet"}'},
        },
    ]
    client.chat.completions.create(
        model="base",
        messages=[
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": "Checking.", "tool_calls": calls},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
            {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        ],
        tools=[TOOLS[0]],
        tool_choice="none",
    )
    assert server.engine.prompts_seen[-1] == prompt
    text = server.http.post("/detokenize", json={"model": "base", "tokens": prompt}).json()["prompt"]
    assert (
        "TOOLS=function:get_weather" in text and "CALL call_1 get_weather" in text and "[call_2]noon" in text
    )


EVENTS_OF_A_MESSAGE = [
    "response.created",
    "response.in_progress",
    "response.output_item.added",
    "response.content_part.added",
    *["response.output_text.delta"] * EOS_AFTER,
    "response.output_text.done",
    "response.content_part.done",
    "response.output_item.done",
    "response.completed",
]


@pytest.mark.parametrize("model", ["base", "sql"])
def test_the_stream_assembles_the_non_streamed_response(server: RunningServer, model: str) -> None:
    client = _client(server)
    body = dict(model=model, input="Tell me", metadata={"run": "7"}, user="u-1", temperature=0.5, top_p=0.9)
    whole = client.responses.create(**body)
    with client.responses.stream(**body) as stream:
        events = list(stream)
        final = stream.get_final_response()
    assert [e.type for e in events] == EVENTS_OF_A_MESSAGE
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert _shape(final) == _shape(whole)
    assert (
        final.metadata == {"run": "7"}
        and final.user == "u-1"
        and (final.temperature, final.top_p) == (0.5, 0.9)
    )
    created, done = events[0].response, events[-1].response
    assert created.status == "in_progress" and created.output == [] and created.id == final.id
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == whole.output_text
    raw = server.sse_events("/v1/responses", {**body, "stream": True})
    assert raw[0]["type"] == "response.created" and raw[-1]["type"] == "response.completed"
    assert done.output[0].id == events[2].item.id  # the item keeps its id from added to done
    assert client.responses.retrieve(final.id).output_text == whole.output_text  # stored once finished


def test_a_stream_cut_by_max_output_tokens_ends_incomplete(server: RunningServer) -> None:
    events = server.sse_events(
        "/v1/responses", {"model": "sql", "input": "hi", "max_output_tokens": 2, "stream": True}
    )
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"
    assert events[-2]["item"]["status"] == "incomplete"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_retrieve_and_previous_response_id_chains(server: RunningServer) -> None:
    client = _client(server)
    first = client.responses.create(model="sql", instructions="Answer in French.", input="Hello")
    assert _shape(client.responses.retrieve(first.id)) == _shape(first)
    second = client.responses.create(model="sql", input="And now?", previous_response_id=first.id)
    third = client.responses.create(
        model="sql", input=[{"role": "user", "content": "Last."}], previous_response_id=second.id
    )
    prompt = server.engine.prompts_seen[-1]
    # The chain is the whole conversation; instructions are not carried over (OpenAI's rule).
    chat = [
        {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "And now?"},
        {"role": "assistant", "content": second.output_text},
        {"role": "user", "content": "Last."},
    ]
    client.chat.completions.create(model="sql", messages=chat)
    assert server.engine.prompts_seen[-1] == prompt and third.previous_response_id == second.id
    unstored = client.responses.create(model="sql", input="x", store=False)
    assert unstored.store is False
    for missing, param in ((unstored.id, None), ("resp_nope", "previous_response_id")):
        with pytest.raises(openai.NotFoundError) as info:
            if param is None:
                client.responses.retrieve(missing)
            else:
                client.responses.create(model="sql", input="x", previous_response_id=missing)
        error = info.value.body
        assert f"Response with id '{missing}' not found." in error["message"] and error["param"] == param, (
            error
        )
    deleted = server.http.delete(f"/v1/responses/{first.id}").json()
    assert deleted == {"id": first.id, "object": "response.deleted", "deleted": True}
    assert server.http.get(f"/v1/responses/{first.id}").status_code == 404


def test_the_store_evicts_the_oldest_by_count_and_by_bytes(small_store: RunningServer) -> None:
    client = _client(small_store)
    ids = [client.responses.create(model="base", input=f"q{i}").id for i in range(4)]  # holds 3
    assert small_store.http.get(f"/v1/responses/{ids[0]}").status_code == 404
    assert all(small_store.http.get(f"/v1/responses/{i}").status_code == 200 for i in ids[1:])
    store = small_store.app.state.responses_store
    assert len(store) == 3 and store.num_bytes < 6000 < store.num_bytes + 4500  # ~1 KB each
    big = client.responses.create(model="base", input="y" * 4500).id  # 4.5 KB in its conversation
    kept = [i for i in [*ids[1:], big] if small_store.http.get(f"/v1/responses/{i}").status_code == 200]
    assert kept == [big] and store.num_bytes <= 6000  # the byte limit evicted what the count kept
    reply = small_store.http.get(f"/v1/responses/{ids[1]}")
    assert reply.status_code == 404 and f"'{ids[1]}'" in reply.json()["error"]["message"]
    assert reply.json()["error"]["type"] == "NotFoundError"
    with pytest.raises(openai.NotFoundError):  # a chain through an evicted response is a 404 naming it
        client.responses.create(model="base", input="z", previous_response_id=ids[0])


def test_a_background_response_runs_and_can_be_cancelled(server: RunningServer) -> None:
    client = _client(server)
    hold_generation(server, num_free_tokens=1)
    try:
        queued = client.responses.create(model="sql", input="slow one", background=True)
        assert queued.status == "queued" and queued.background is True and queued.output == []
        wait_for(
            lambda: client.responses.retrieve(queued.id).status == "in_progress", what="the response to start"
        )
        request_id = next(iter(server.engine.running))
        cancelled = client.responses.cancel(queued.id)
        assert cancelled.status == "cancelled" and request_id in server.engine.aborted
        assert client.responses.retrieve(queued.id).status == "cancelled"
        assert client.responses.cancel(queued.id).status == "cancelled"  # again: the same answer
    finally:
        release_generation(server)
    done = client.responses.create(model="sql", input="fast one", background=True)
    wait_for(lambda: client.responses.retrieve(done.id).status == "completed", what="the response to finish")
    whole = client.responses.create(model="sql", input="fast one")
    assert _shape(client.responses.retrieve(done.id))["output"] == _shape(whole)["output"]
    with pytest.raises(openai.BadRequestError, match="already finished"):
        client.responses.cancel(done.id)
    with pytest.raises(openai.BadRequestError, match="Cannot cancel a synchronous response."):
        client.responses.cancel(whole.id)


WEB_SEARCH = {"type": "web_search"}
REFUSED: list[tuple[dict[str, Any], str, str]] = [
    ({"tools": [WEB_SEARCH]}, "the built-in tool 'web_search' is not offered", "tools"),
    (
        {"tools": [FUNCTION, {"type": "file_search", "vector_store_ids": ["v"]}]},
        "'file_search' is not offered",
        "tools",
    ),
    (
        {"tools": [{"type": "mcp", "server_label": "x", "server_url": "http://x"}]},
        "'mcp' is not offered",
        "tools",
    ),
    (
        {"tools": [FUNCTION], "tool_choice": {"type": "web_search_preview"}},
        "'web_search_preview' is not offered",
        "tool_choice",
    ),
    (
        {"reasoning": {"effort": "high"}},
        "reasoning is not offered: the model served here does not reason",
        "reasoning",
    ),
    (
        {"input": [{"type": "reasoning", "id": "rs_1", "summary": []}]},
        "reasoning items are not offered",
        "input",
    ),
    (
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "http://x/y.png"}]}]},
        "content of type 'input_image' is not offered",
        "input",
    ),  # fmt: skip
    (
        {"input": [{"type": "item_reference", "id": "msg_1"}]},
        "items of type 'item_reference' are not offered",
        "input",
    ),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role: 'tool' is not one of", "input"),
    (
        {"include": ["message.output_text.logprobs"]},
        "'message.output_text.logprobs' is not offered",
        "include",
    ),
    ({"truncation": "auto"}, 'truncation "auto" is not offered', "truncation"),
    ({"background": True, "store": False}, "background can only be used when `store` is true", "background"),
    ({"background": True, "stream": True}, "background together with stream is not offered", "background"),
    ({"conversation": "conv_1"}, "conversation is not offered", "conversation"),
    ({"text": {"verbosity": "high"}}, "text.verbosity 'high' is not offered", "text.verbosity"),
    ({"service_tier": "flex"}, "service_tier 'flex' is not offered", "service_tier"),
    ({"top_logprobs": 3}, "top_logprobs is not offered", "top_logprobs"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "needs a schema", "text.format.schema"),
    (
        {"tools": [FUNCTION], "tool_choice": "auto"},
        '"auto" tool choice requires --enable-auto-tool-choice',
        "tool_choice",
    ),
    (
        {"tools": [FUNCTION], "tool_choice": {"type": "function", "name": "nope"}},
        "does not match any of the specified `tools`",
        "tool_choice",
    ),  # fmt: skip
    ({"max_output_tokens": 100000}, "maximum context length", "max_output_tokens"),
    ({"input": [], "instructions": None}, "nothing to answer", "input"),
    (
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{oops"}]},
        "is not valid JSON",
        "input",
    ),  # fmt: skip
    ({"logits_processors": ["x"]}, "logits_processors is not supported", "logits_processors"),
    ({"temperature": "hot"}, "Input should be a valid number", "temperature"),
]


@pytest.mark.parametrize(("fields", "message", "param"), REFUSED)
def test_what_is_not_offered_is_a_400_naming_it(
    server: RunningServer, fields: dict[str, Any], message: str, param: str
) -> None:
    body = {"model": "base", "input": "hi", **fields}
    reply = server.http.post("/v1/responses", json=body)
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert message in error["message"] and error["param"] == param, error
    assert error["type"] == "BadRequestError" and error["code"] == 400
    assert server.http.post("/v1/responses", json={"model": "base", "input": "hi"}).status_code == 200


def test_an_unknown_model_is_a_404(server: RunningServer) -> None:
    with pytest.raises(openai.NotFoundError, match="The model `nope` does not exist"):
        _client(server).responses.create(model="nope", input="hi")
