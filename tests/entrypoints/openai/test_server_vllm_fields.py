"""vLLM's request fields the serving layer applies (fake engine, real server), base model and adapter:
echo, request_id, truncate_prompt_tokens and truncation_side, return_token_ids, continue_final_message,
documents, an empty model name, vLLM's validation texts (priority, cache_salt, seed, top_logprobs), and
the null system_fingerprint and service_tier keys of every response and chunk."""

from __future__ import annotations

import json
import threading
from typing import Any

import openai
import pytest
from support.fake_engine import FakeEngine, hold_generation, release_generation
from support.fake_server_fixtures import expected_ids, sql_id
from support.harness import RunningServer, wait_for

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions

MESSAGES = [{"role": "user", "content": "Say yes."}]
PREFILL = [*MESSAGES, {"role": "assistant", "content": "Yes, and"}]


def _lora(server: RunningServer, model: str) -> int:
    return sql_id(server) if model == "sql" else 0


@pytest.mark.parametrize("model", ["base", "sql"])
def test_echo_puts_the_prompt_first(
    server: RunningServer, client: openai.OpenAI, tokenizer, model: str
) -> None:
    prompt = "Once upon a time"
    out = client.completions.create(model=model, prompt=prompt, max_tokens=3, echo=True)
    ids = expected_ids(server, tokenizer.encode(prompt), 3, _lora(server, model))
    assert out.choices[0].text == prompt + tokenizer.decode(ids)
    token_prompt = tokenizer.encode("two words")
    by_ids = client.completions.create(model=model, prompt=token_prompt, max_tokens=2, echo=True, n=2)
    for choice in by_ids.choices:
        generated = expected_ids(server, token_prompt, 2, _lora(server, model), choice.index)
        assert choice.text == tokenizer.decode(token_prompt) + tokenizer.decode(generated)
    streamed = client.completions.create(model=model, prompt=prompt, max_tokens=3, echo=True, stream=True)
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == out.choices[0].text


@pytest.mark.parametrize("model", ["base", "sql"])
def test_chat_echo_repeats_a_final_assistant_message(server: RunningServer, model: str) -> None:
    body = {"model": model, "messages": PREFILL, "max_tokens": 2, "echo": True}
    body.update(add_generation_prompt=False, continue_final_message=True)
    reply = server.http.post("/v1/chat/completions", json=body).json()
    plain = server.http.post("/v1/chat/completions", json={**body, "echo": False}).json()
    assert reply["choices"][0]["message"]["content"] == "Yes, and" + plain["choices"][0]["message"]["content"]
    streamed = server.http.post("/v1/chat/completions", json={**body, "stream": True}).text
    deltas = [json.loads(line[6:]) for line in streamed.splitlines() if line.startswith("data: {")]
    assert (
        "".join(d["choices"][0]["delta"].get("content") or "" for d in deltas)
        == reply["choices"][0]["message"]["content"]
    )
    user_last = server.http.post(
        "/v1/chat/completions", json={"model": model, "messages": MESSAGES, "max_tokens": 2, "echo": True}
    ).json()
    assert not user_last["choices"][0]["message"]["content"].startswith("Say yes.")


@pytest.mark.parametrize("model", ["base", "sql"])
def test_request_id_names_the_response(server: RunningServer, client: openai.OpenAI, model: str) -> None:
    out = client.completions.create(model=model, prompt="x", max_tokens=2, extra_body={"request_id": "abc-1"})
    assert out.id == "cmpl-abc-1"
    chat = client.chat.completions.create(
        model=model, messages=MESSAGES, max_tokens=2, extra_body={"request_id": "abc-1"}
    )
    assert chat.id == "chatcmpl-abc-1"
    assert client.completions.create(model=model, prompt="x", max_tokens=2).id.startswith("cmpl-")
    # vLLM: the X-Request-Id header, when sent, names the response over the body's request_id.
    body = {"model": model, "prompt": "x", "max_tokens": 2, "request_id": "from-body"}
    headed = server.http.post("/v1/completions", json=body, headers={"X-Request-Id": "from-header"})
    assert headed.json()["id"] == "cmpl-from-header"
    bad = server.http.post("/v1/completions", json={**body, "request_id": "a\nb"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"


def test_two_requests_may_share_a_request_id(server: RunningServer) -> None:
    """The id names responses; the engine's ids stay unique, so a reused id never fails a request."""
    hold_generation(server, num_free_tokens=1)
    replies: list[Any] = []
    body = {"model": "sql", "prompt": "same", "max_tokens": 3, "request_id": "shared"}
    threads = [
        threading.Thread(target=lambda: replies.append(server.http.post("/v1/completions", json=body)))
        for _ in range(2)
    ]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(server.engine.running) == 2, what="both requests running")
    finally:
        release_generation(server)
        for thread in threads:
            thread.join(30)
    assert [r.status_code for r in replies] == [200, 200]
    assert {r.json()["id"] for r in replies} == {"cmpl-shared"}


@pytest.mark.parametrize("model", ["base", "sql"])
def test_truncate_prompt_tokens_keeps_the_last_tokens(server: RunningServer, tokenizer, model: str) -> None:
    prompt = "one two three four five six seven eight"
    ids = tokenizer.encode(prompt)
    reply = server.http.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": 3},
    )
    assert reply.status_code == 200 and server.engine.prompts_seen[-1] == ids[-3:]
    assert reply.json()["usage"]["prompt_tokens"] == 3
    chat = server.http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 2, "truncate_prompt_tokens": 4},
    )
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert chat.status_code == 200
    assert server.engine.prompts_seen[-1] == tokenizer.encode(rendered, add_special_tokens=False)[-4:]
    whole = server.http.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": -1},
    )
    assert whole.status_code == 200 and server.engine.prompts_seen[-1] == ids
    too_long = server.http.post(
        "/v1/completions",
        json={"model": model, "prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": 1000},
    )
    assert too_long.status_code == 400
    assert too_long.json()["error"]["message"] == (
        f"truncate_prompt_tokens value (1000) is greater than max_model_len ({server.engine.max_model_len}). "
        "Please, select a smaller truncation size."
    )


@pytest.mark.parametrize("model", ["base", "sql"])
def test_return_token_ids(server: RunningServer, client: openai.OpenAI, tokenizer, model: str) -> None:
    prompt_ids = tokenizer.encode("give ids")
    out = client.completions.create(
        model=model, prompt="give ids", max_tokens=3, n=2, extra_body={"return_token_ids": True}
    )
    for choice in out.choices:
        assert choice.prompt_token_ids == prompt_ids  # type: ignore[attr-defined]
        assert choice.token_ids == expected_ids(server, prompt_ids, 3, _lora(server, model), choice.index)  # type: ignore[attr-defined]
    chat = server.http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": MESSAGES, "max_tokens": 3, "return_token_ids": True},
    ).json()
    chat_prompt = server.engine.prompts_seen[-1]
    assert chat["prompt_token_ids"] == chat_prompt
    assert chat["choices"][0]["token_ids"] == expected_ids(server, chat_prompt, 3, _lora(server, model))
    streamed = client.completions.create(
        model=model, prompt="give ids", max_tokens=3, stream=True, extra_body={"return_token_ids": True}
    )
    chunks = [chunk.choices[0] for chunk in streamed if chunk.choices]
    assert chunks[0].prompt_token_ids == prompt_ids  # type: ignore[attr-defined]
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    assert sum((c.token_ids for c in chunks), []) == expected_ids(server, prompt_ids, 3, _lora(server, model))  # type: ignore[attr-defined]
    plain = client.completions.create(model=model, prompt="give ids", max_tokens=3)
    assert getattr(plain.choices[0], "token_ids", None) is None


def test_continue_final_message_leaves_the_assistant_turn_open(server: RunningServer, tokenizer) -> None:
    body = {"model": "sql", "messages": PREFILL, "max_tokens": 2, "add_generation_prompt": False}
    reply = server.http.post("/v1/chat/completions", json={**body, "continue_final_message": True})
    assert reply.status_code == 200, reply.text
    rendered = tokenizer.apply_chat_template(PREFILL, tokenize=False, continue_final_message=True)
    assert rendered.rstrip().endswith("Yes, and")
    assert server.engine.prompts_seen[-1] == tokenizer.encode(rendered, add_special_tokens=False)
    both = server.http.post(
        "/v1/chat/completions", json={**body, "continue_final_message": True, "add_generation_prompt": True}
    )
    assert both.status_code == 400
    assert both.json()["error"]["message"] == (
        "Cannot set both `continue_final_message` and `add_generation_prompt` to True."
    )


DOCS_TEMPLATE = (
    "{% for d in documents %}[doc {{ d.title }}: {{ d.text }}]{% endfor %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}<assistant>"
)


def test_documents_reach_the_chat_template(tokenizer_dir: str, adapter_dir: str) -> None:
    from transformers import AutoTokenizer

    from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)  # its own: --chat-template replaces the template

    options = ServerOptions(
        served_model_names=["base"],
        lora_modules=[LoRAModulePath("sql", adapter_dir)],
        frontend=FrontendOptions(chat_template=DOCS_TEMPLATE),
    )
    docs = [{"title": "a", "text": "sky is blue"}, {"title": "b", "text": "grass is green"}]
    with RunningServer(FakeEngine(tokenizer), options) as running:
        for model in ("base", "sql"):
            body = {"model": model, "messages": MESSAGES, "max_tokens": 2, "documents": docs}
            assert running.http.post("/v1/chat/completions", json=body).status_code == 200
            text = "[doc a: sky is blue][doc b: grass is green]<user>Say yes.<assistant>"
            assert running.engine.prompts_seen[-1] == tokenizer.encode(text, add_special_tokens=False)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_an_empty_model_name_is_the_default_model(server: RunningServer, path: str) -> None:
    body: dict[str, Any] = {"model": "", "max_tokens": 2}
    body.update({"prompt": "x"} if "chat" not in path else {"messages": MESSAGES})
    reply = server.http.post(path, json=body)
    assert reply.status_code == 200, reply.text
    assert reply.json()["model"] == "base"


def test_validation_texts_are_vllms(server: RunningServer, client: openai.OpenAI) -> None:
    def error(path: str, **fields: Any) -> dict[str, Any]:
        body: dict[str, Any] = {"model": "sql", "max_tokens": 2, **fields}
        body.update({"prompt": "x"} if "chat" not in path else {"messages": MESSAGES})
        reply = server.http.post(path, json=body)
        assert reply.status_code == 400, reply.text
        return reply.json()["error"]

    for path in ("/v1/completions", "/v1/chat/completions"):
        assert error(path, priority=2)["message"] == "Got priority 2 but Priority scheduling is not enabled."
        salt = error(path, cache_salt="")
        assert salt["message"] == "Parameter 'cache_salt' must be a non-empty string if provided."
        assert "less_than_equal" in error(path, seed=2**64)["message"]
        assert "greater_than_equal" in error(path, seed=-(2**64))["message"]
        assert error(path, prompt_logprobs=1, stream=True)["message"] == (
            "`prompt_logprobs` are not available when `stream=True`."
        )
        assert (
            error(path, prompt_logprobs=-2)["message"] == "`prompt_logprobs` must be a positive value or -1."
        )
    chat = "/v1/chat/completions"
    assert (
        error(chat, top_logprobs=-2, logprobs=True)["message"]
        == "`top_logprobs` must be a positive value or -1."
    )
    assert (
        error(chat, top_logprobs=3)["message"] == "when using `top_logprobs`, `logprobs` must be set to true."
    )
    with pytest.raises(openai.BadRequestError, match="less_than_equal"):
        client.completions.create(model="base", prompt="x", max_tokens=2, seed=2**64)
    # The "off" values are accepted.
    ok = server.http.post(
        "/v1/completions", json={"model": "sql", "prompt": "x", "max_tokens": 2, "priority": 0}
    )
    assert ok.status_code == 200


def test_priority_and_cache_salt_reach_the_engine(tokenizer, adapter_dir: str) -> None:
    from loraserve.config import SchedulerConfig
    from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

    engine = FakeEngine(tokenizer)
    engine.scheduler_config = SchedulerConfig(scheduling_policy="priority")
    options = ServerOptions(served_model_names=["base"], lora_modules=[LoRAModulePath("sql", adapter_dir)])
    with RunningServer(engine, options) as running:
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
        for model in ("base", "sql"):
            client.completions.create(
                model=model, prompt=["a", "b"], max_tokens=2, extra_body={"priority": -3, "cache_salt": "t1"}
            )
            assert engine.priorities_seen[-2:] == [-3, -3] and engine.salts_seen[-2:] == ["t1", "t1"]
            client.chat.completions.create(
                model=model, messages=MESSAGES, max_tokens=2, extra_body={"priority": 7}
            )
            assert engine.priorities_seen[-1] == 7
            assert len(engine.salts_seen) == 2 * (1 + (model == "sql"))  # no salt: a plain prompt


@pytest.mark.parametrize("model", ["base", "sql"])
def test_echo_with_max_tokens_zero_returns_the_prompt_alone(
    server: RunningServer, client: openai.OpenAI, model: str
) -> None:
    """vLLM's echo-only form (lm-eval's loglikelihood requests): the prompt, no generated token."""
    out = client.completions.create(model=model, prompt="just this", max_tokens=0, echo=True)
    assert out.choices[0].text == "just this" and out.usage.completion_tokens == 0
    streamed = client.completions.create(
        model=model, prompt="just this", max_tokens=0, echo=True, stream=True
    )
    assert "".join(c.choices[0].text for c in streamed if c.choices) == "just this"
    with pytest.raises(openai.BadRequestError, match="max_tokens"):
        client.completions.create(model=model, prompt="just this", max_tokens=0)


@pytest.mark.parametrize("model", ["base", "sql"])
def test_truncation_side_right_keeps_the_first_tokens(server: RunningServer, tokenizer, model: str) -> None:
    prompt = "one two three four five six seven eight"
    ids = tokenizer.encode(prompt)
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "truncate_prompt_tokens": 3}
    right = server.http.post("/v1/completions", json={**body, "truncation_side": "right"})
    assert right.status_code == 200 and server.engine.prompts_seen[-1] == ids[:3]
    assert right.json()["usage"]["prompt_tokens"] == 3
    left = server.http.post("/v1/completions", json={**body, "truncation_side": "left"})
    assert left.status_code == 200 and server.engine.prompts_seen[-1] == ids[-3:]
    chat = {"model": model, "messages": MESSAGES, "max_tokens": 2, "truncate_prompt_tokens": 4}
    reply = server.http.post("/v1/chat/completions", json={**chat, "truncation_side": "right"})
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert reply.status_code == 200
    assert server.engine.prompts_seen[-1] == tokenizer.encode(rendered, add_special_tokens=False)[:4]
    bad = server.http.post("/v1/completions", json={**body, "truncation_side": "middle"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "truncation_side", bad.text


def test_responses_and_chunks_carry_null_fingerprint_and_service_tier(server: RunningServer) -> None:
    keys = {"system_fingerprint": None, "service_tier": None}
    for path, body in (
        ("/v1/completions", {"model": "sql", "prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"model": "base", "messages": MESSAGES, "max_tokens": 2}),
    ):
        whole = server.http.post(path, json=body).json()
        assert {k: whole[k] for k in keys if k in whole} == keys, whole
        events = server.sse_events(path, {**body, "stream": True, "stream_options": {"include_usage": True}})
        chunks = [e for e in events if e != "[DONE]"]
        assert len(chunks) >= 3 and all({k: c[k] for k in keys if k in c} == keys for c in chunks), chunks
