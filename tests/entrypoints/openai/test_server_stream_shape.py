"""Stream shape as OpenAI and vLLM send it (fake engine, real server): one choice per chunk, so a
client reading `chunk.choices[0]` sees every choice finish; usage in every chunk with
`continuous_usage_stats`; `stream_options` only with `stream: true`."""

from __future__ import annotations

import json
from collections import defaultdict
from typing import Any

import openai
import pytest
from support.fake_server_fixtures import expected_ids, sql_id
from support.harness import RunningServer

MESSAGES = [{"role": "user", "content": "Tell me something."}]


def _events(server: RunningServer, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    reply = server.http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    lines = [line.removeprefix("data: ") for line in reply.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("model", ["base", "sql"])
def test_completion_stream_sends_one_choice_per_chunk(server: RunningServer, tokenizer, model: str) -> None:
    prompts = ["first prompt", "second one"]
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0)
    stream = client.completions.create(model=model, prompt=prompts, n=3, max_tokens=4, stream=True)
    texts: dict[int, str] = defaultdict(str)
    finished: dict[int, str] = {}
    for chunk in stream:
        assert len(chunk.choices) == 1  # what chunk.choices[0] readers rely on
        choice = chunk.choices[0]
        texts[choice.index] += choice.text
        if choice.finish_reason is not None:
            finished[choice.index] = choice.finish_reason
    assert sorted(finished) == list(range(6)) and set(finished.values()) == {"length"}
    lora_id = sql_id(server) if model == "sql" else 0
    for p, prompt in enumerate(prompts):
        for i in range(3):
            ids = expected_ids(server, tokenizer.encode(prompt), 4, lora_id, i)
            assert texts[p * 3 + i] == tokenizer.decode(ids)


@pytest.mark.parametrize("model", ["base", "sql"])
def test_chat_stream_sends_one_choice_per_chunk(
    server: RunningServer, client: openai.OpenAI, model: str
) -> None:
    stream = client.chat.completions.create(model=model, messages=MESSAGES, n=3, max_tokens=4, stream=True)
    roles: list[int] = []
    texts: dict[int, str] = defaultdict(str)
    finished: set[int] = set()
    for chunk in stream:
        assert len(chunk.choices) == 1
        choice = chunk.choices[0]
        if choice.delta.role:
            roles.append(choice.index)
        texts[choice.index] += choice.delta.content or ""
        if choice.finish_reason is not None:
            finished.add(choice.index)
    assert roles == [0, 1, 2] and finished == {0, 1, 2}
    whole = client.chat.completions.create(model=model, messages=MESSAGES, n=3, max_tokens=4)
    assert {c.index: c.message.content for c in whole.choices} == dict(texts)


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/completions", {"prompt": "count me", "n": 2}),
        ("/v1/chat/completions", {"messages": MESSAGES, "n": 2}),
    ],
)
@pytest.mark.parametrize("model", ["base", "sql"])
def test_continuous_usage_stats_put_usage_in_every_chunk(
    server: RunningServer, path: str, body: dict[str, Any], model: str
) -> None:
    options = {"include_usage": True, "continuous_usage_stats": True}
    events = _events(
        server, path, {**body, "model": model, "max_tokens": 3, "stream": True, "stream_options": options}
    )
    *chunks, final = events
    assert final["choices"] == [] and final["usage"]["completion_tokens"] == 6
    prompt_tokens = final["usage"]["prompt_tokens"]
    sent: dict[int, int] = defaultdict(int)
    for chunk in chunks:
        usage = chunk["usage"]
        index = chunk["choices"][0]["index"]
        if chunk["choices"][0].get("text") or chunk["choices"][0].get("delta", {}).get("content"):
            sent[index] += 1
        assert usage["prompt_tokens"] == prompt_tokens
        assert usage["completion_tokens"] == sent[index]  # this choice's tokens so far (one per chunk here)
        assert usage["total_tokens"] == prompt_tokens + sent[index]
    plain = _events(
        server,
        path,
        {**body, "model": model, "max_tokens": 3, "stream": True, "stream_options": {"include_usage": True}},
    )
    assert all("usage" not in chunk for chunk in plain[:-1]) and plain[-1]["usage"] == final["usage"]


@pytest.mark.parametrize(
    "path, body",
    [("/v1/completions", {"prompt": "x"}), ("/v1/chat/completions", {"messages": MESSAGES})],
)
def test_stream_options_need_stream(server: RunningServer, path: str, body: dict[str, Any]) -> None:
    for stream in (False, None):
        request = {**body, "model": "base", "max_tokens": 2, "stream_options": {"include_usage": True}}
        if stream is not None:
            request["stream"] = stream
        reply = server.http.post(path, json=request)
        assert reply.status_code == 400
        error = reply.json()["error"]
        assert error["message"] == "Stream options can only be defined when `stream=True`."
        assert error["param"] == "stream_options"
    empty = server.http.post(path, json={**body, "model": "base", "max_tokens": 2, "stream_options": {}})
    assert empty.status_code == 200  # vLLM checks for options that ask for something


def test_stream_options_error_through_the_openai_client(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="Stream options can only be defined when `stream=True`"):
        client.completions.create(
            model="sql", prompt="x", max_tokens=2, stream_options={"include_usage": True}
        )
