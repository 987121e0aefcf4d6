"""HTTP API over a real uvicorn server and the fake engine: completions, chat, streaming, models, metrics.

The oracle for every generated field is the engine itself: what the toy model yields for the same
prompt ids, parameters and adapter, which the HTTP layer must pass through unchanged.
"""

from __future__ import annotations

import threading

import openai
from support.fake_engine import FakeEngine, hold_generation, release_generation
from support.fake_server_fixtures import expected_ids, sql_id
from support.harness import RunningServer, wait_for

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.engine_client import EngineClient
from loraserve.sampling_params import SamplingParams

API_KEY = "sk-test-key"



def test_completion_matches_engine(server: RunningServer, client: openai.OpenAI, tokenizer) -> None:
    prompt = "The quick brown fox"
    prompt_ids = tokenizer.encode(prompt)
    for model, lora_id in (("base", 0), ("base-alias", 0), ("sql", sql_id(server))):
        result = client.completions.create(model=model, prompt=prompt, max_tokens=5, temperature=0)
        ids = expected_ids(server, prompt_ids, 5, lora_id)
        assert result.model == model
        assert result.choices[0].text == tokenizer.decode(ids)
        assert result.choices[0].finish_reason == "length"
        assert result.usage.prompt_tokens == len(prompt_ids)
        assert result.usage.completion_tokens == 5
        assert result.usage.total_tokens == len(prompt_ids) + 5
    assert server.engine.prompts_seen[-1] == prompt_ids


def test_completion_batch_n_and_token_prompts(
    server: RunningServer, client: openai.OpenAI, tokenizer
) -> None:
    prompts = [[10, 11, 12], [40, 41]]
    result = client.completions.create(model="base", prompt=prompts, n=2, max_tokens=3)
    assert [c.index for c in result.choices] == [0, 1, 2, 3]
    for choice in result.choices:
        prompt_index, seq_index = divmod(choice.index, 2)
        ids = server.engine.expected_token_ids(
            prompts[prompt_index], SamplingParams(max_tokens=3), 0, seq_index
        )
        assert choice.text == tokenizer.decode(ids)
    assert result.usage.prompt_tokens == 5 and result.usage.completion_tokens == 12


def test_completion_stop_and_logprobs(server: RunningServer, client: openai.OpenAI, tokenizer) -> None:
    prompt_ids = tokenizer.encode("SELECT name")
    full = tokenizer.decode(expected_ids(server, prompt_ids, 8))
    stop = full[len(full) // 2 : len(full) // 2 + 2]
    result = client.completions.create(model="base", prompt="SELECT name", max_tokens=8, stop=[stop])
    assert result.choices[0].text == full[: full.index(stop)]
    assert result.choices[0].finish_reason == "stop"

    result = client.completions.create(model="base", prompt="SELECT name", max_tokens=4, logprobs=2)
    logprobs = result.choices[0].logprobs
    ids = expected_ids(server, prompt_ids, 4)
    assert logprobs.tokens == [tokenizer.decode([t]) for t in ids]
    assert logprobs.token_logprobs == [-0.5] * 4
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)
    assert logprobs.text_offset[0] == 0


def test_completion_stream(server: RunningServer, client: openai.OpenAI, tokenizer) -> None:
    prompt_ids = tokenizer.encode("Bonjour")
    stream = client.completions.create(
        model="sql", prompt="Bonjour", max_tokens=6, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == tokenizer.decode(expected_ids(server, prompt_ids, 6, sql_id(server)))
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 6

    events = server.sse_events(
        "/v1/completions", {"model": "base", "prompt": "Bonjour", "max_tokens": 3, "stream": True}
    )
    assert events[-1] == "[DONE]" and len(events) == 4


def test_chat_uses_template_and_streams(server: RunningServer, client: openai.OpenAI, tokenizer) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hello there"}]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tokenizer.encode(rendered, add_special_tokens=False)
    result = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=5, logprobs=True, top_logprobs=2
    )
    assert server.engine.prompts_seen[-1] == prompt_ids
    ids = expected_ids(server, prompt_ids, 5, sql_id(server))
    assert result.choices[0].message.role == "assistant"
    assert result.choices[0].message.content == tokenizer.decode(ids)
    content = result.choices[0].logprobs.content
    assert [c.token for c in content] == [tokenizer.decode([t]) for t in ids]
    assert all(len(c.top_logprobs) == 2 and c.top_logprobs[0].token == c.token for c in content)
    assert result.usage.prompt_tokens == len(prompt_ids)

    chunks = list(
        client.chat.completions.create(
            model="sql",
            messages=messages,
            max_tokens=5,
            n=2,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    for index in (0, 1):
        text = "".join(
            choice.delta.content or "" for c in chunks for choice in c.choices if choice.index == index
        )
        assert text == tokenizer.decode(
            server.engine.expected_token_ids(prompt_ids, SamplingParams(max_tokens=5), sql_id(server), index)
        )
    assert chunks[-1].usage.completion_tokens == 10


def test_fake_engine_is_an_engine_client(server: RunningServer) -> None:
    assert isinstance(server.engine, EngineClient)


def test_models_version_health_metrics(
    server: RunningServer, client: openai.OpenAI, adapter_dir: str
) -> None:
    cards = {m.id: m for m in client.models.list().data}
    assert set(cards) == {"base", "base-alias", "sql"}
    assert cards["sql"].root == adapter_dir and cards["sql"].parent == "base"
    assert cards["base"].root == server.engine.model_config.model
    assert server.http.get("/health").status_code == 200
    assert server.http.get("/version").json()["version"]
    client.completions.create(model="sql", prompt=[7, 8, 9], max_tokens=2)
    metrics = server.http.get("/metrics").text
    for name in (
        "loraserve:requests_total",
        "loraserve:prompt_tokens_total",
        "loraserve:generation_tokens_total",
        "loraserve:time_to_first_token_seconds_bucket",
        "loraserve:inter_token_latency_seconds_bucket",
        "loraserve:num_requests_running",
        "loraserve:lora_add_seconds_count",
    ):
        assert name in metrics, name
    assert 'loraserve:requests_total{finished_reason="length",model_name="sql"}' in metrics
    # The engine's drained load latencies land in a histogram, counted once across scrapes.
    assert "loraserve:lora_load_seconds_count 1.0" in metrics
    assert "loraserve:lora_load_seconds_count 1.0" in server.http.get("/metrics").text


def test_running_counts_per_adapter(server: RunningServer) -> None:
    hold_generation(server)
    try:
        worker = threading.Thread(
            target=lambda: server.http.post(
                "/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2}
            )
        )
        worker.start()
        wait_for(lambda: len(server.engine.running) == 1, what="the request to run")
        metrics = server.http.get("/metrics").text
        assert 'loraserve:num_requests_running_by_lora{lora_name="sql"} 1.0' in metrics
        assert "loraserve:num_requests_running 1.0" in metrics
    finally:
        release_generation(server)
    worker.join(30)
    assert "loraserve:num_requests_running 0.0" in server.http.get("/metrics").text


def test_retrieve_model(server: RunningServer, client: openai.OpenAI) -> None:
    listed = {card.id: card for card in client.models.list().data}
    for model_id in ("base", "base-alias", "sql"):
        card = client.models.retrieve(model_id)
        same = card.model_dump(exclude={"created"}) == listed[model_id].model_dump(exclude={"created"})
        assert card.id == model_id and same  # "created" is the time of each answer
    missing = server.http.get("/v1/models/org/no-such-model")
    assert missing.status_code == 404
    assert missing.json()["error"]["message"] == "The model `org/no-such-model` does not exist."


UNTRUSTED = "{% for m in messages %}[{{ m['content'] }}]{% endfor %}"


def test_request_chat_templates_need_the_operators_trust(server: RunningServer, tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}]
    for extra in ({"chat_template": UNTRUSTED}, {"chat_template_kwargs": {"chat_template": UNTRUSTED}}):
        reply = server.http.post(
            "/v1/chat/completions", json={"model": "base", "messages": messages, "max_tokens": 2, **extra}
        )
        assert reply.status_code == 400 and reply.json()["error"]["param"] == "chat_template"
        assert "--trust-request-chat-template" in reply.json()["error"]["message"]
    options = ServerOptions(served_model_names=["base"], trust_request_chat_template=True)
    with RunningServer(FakeEngine(tokenizer), options) as trusting:
        reply = trusting.http.post(
            "/v1/chat/completions",
            json={"model": "base", "messages": messages, "max_tokens": 2, "chat_template": UNTRUSTED},
        )
        assert reply.status_code == 200
        assert trusting.engine.prompts_seen[-1] == tokenizer.encode("[hi]", add_special_tokens=False)


def test_non_finite_sampling_values_are_refused(server: RunningServer) -> None:
    for field in ("temperature", "repetition_penalty"):
        body = '{"model": "base", "prompt": "x", "max_tokens": 2, "' + field + '": 1e999}'
        reply = server.http.post(
            "/v1/completions", content=body, headers={"Content-Type": "application/json"}
        )
        assert reply.status_code == 400, (field, reply.text)
        assert "finite" in reply.json()["error"]["message"]
