"""logit_bias, allowed_token_ids and bad_words through the OpenAI client and plain HTTP against a live
server (tiny random Llama + a PEFT adapter), on completions and chat, with vLLM's 400 texts."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import torch
from support.harness import RunningServer

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath
from loraserve.sampling_tokens import tokenize_bad_words

MODELS = ["tiny", "sql"]
MESSAGES = [{"role": "user", "content": "Tell me something."}]


@pytest.fixture(scope="module")
def server(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    adapter = str(tmp_path_factory.mktemp("tc") / "sql")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_peft_adapter(base, adapter, 78, model_dir, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            device="cpu",
            max_model_len=128,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            kv_cache_memory_bytes=16 << 20,
        )  # fmt: skip
    )
    options = ServerOptions(served_model_names=["tiny"], lora_modules=[LoRAModulePath("sql", adapter)])
    with RunningServer(engine, options) as running:
        yield running


@pytest.fixture(scope="module")
def client(server: RunningServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)


def _generate(client: openai.OpenAI, model: str, chat: bool, **fields: Any) -> Any:
    """The first choice of a greedy request (16 tokens, no EOS), with its token ids."""
    extra = {"return_token_ids": True, "ignore_eos": True, **fields.pop("extra_body", {})}
    common: dict[str, Any] = dict(model=model, max_tokens=16, temperature=fields.pop("temperature", 0.0))
    if chat:
        return client.chat.completions.create(messages=MESSAGES, extra_body=extra, **common, **fields).choices
    return client.completions.create(prompt="Once upon", extra_body=extra, **common, **fields).choices


def _contains(tokens: list[int], sequence: list[int]) -> bool:
    return any(tokens[i : i + len(sequence)] == sequence for i in range(len(tokens) - len(sequence) + 1))


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("model", MODELS)
def test_logit_bias_moves_greedy_and_is_clamped(client: openai.OpenAI, model: str, chat: bool) -> None:
    logprobs: dict[str, Any] = {"logprobs": True, "top_logprobs": 2} if chat else {"logprobs": 2}
    plain = _generate(client, model, chat, **logprobs)[0]
    banned = plain.token_ids[0]
    moved = _generate(client, model, chat, logit_bias={str(banned): -100}, **logprobs)[0]
    assert moved.token_ids[0] != banned and banned not in moved.token_ids
    # Logprobs are the raw ones (vLLM's default): the new first token's is what the plain run reported.
    if chat:
        before = {t.token: t.logprob for t in plain.logprobs.content[0].top_logprobs}
        assert moved.logprobs.content[0].logprob == pytest.approx(
            before[moved.logprobs.content[0].token], abs=1e-4
        )
    else:
        before = plain.logprobs.top_logprobs[0]
        assert moved.logprobs.token_logprobs[0] == pytest.approx(before[moved.logprobs.tokens[0]], abs=1e-4)
    # Clamped to [-100, 100] as OpenAI does: +1000 on the runner-up ties with +100 on the best token,
    # so the best still wins, where an unclamped bias would have pushed the runner-up.
    runner_up = moved.token_ids[0]
    clamped = _generate(client, model, chat, logit_bias={str(runner_up): 1000, str(banned): 100})[0]
    assert clamped.token_ids[0] == banned


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("model", MODELS)
def test_allowed_token_ids_restrict_sampled_choices(client: openai.OpenAI, model: str, chat: bool) -> None:
    allowed = [40, 41, 42, 300]
    choices = _generate(client, model, chat, temperature=1.0, n=3, seed=7,
                        extra_body={"allowed_token_ids": allowed})  # fmt: skip
    assert len(choices) == 3 and all(set(c.token_ids) <= set(allowed) for c in choices)


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("model", MODELS)
def test_bad_words_never_appear(client: openai.OpenAI, server: RunningServer, model: str, chat: bool) -> None:
    tokenizer = server.engine.engine.tokenizer
    plain = _generate(client, model, chat)[0].token_ids
    found = None
    for start in range(len(plain) - 1):  # a word from the plain output, as vLLM tokenizes bad words
        word = tokenizer.decode(plain[start : start + 2]).strip()
        sequences = tokenize_bad_words([word], tokenizer) if word else []
        if any(_contains(plain, s) for s in sequences):
            found = word, sequences
            break
    assert found is not None, plain
    word, sequences = found
    banned = _generate(client, model, chat, extra_body={"bad_words": [word]})[0].token_ids
    assert banned != plain and not any(_contains(banned, s) for s in sequences)


def _error(server: RunningServer, path: str, **fields: Any) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "tiny", "max_tokens": 2, **fields}
    body.update({"messages": MESSAGES} if "chat" in path else {"prompt": "hi"})
    # json.dumps escapes to ASCII, so a lone surrogate travels as JSON allows ("\ud800").
    response = server.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert response.status_code == 400, response.text
    return response.json()["error"]


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_vllms_400_texts(server: RunningServer, path: str) -> None:
    vocab = server.engine.engine.model_config.vocab_size
    for stream in (False, True):
        error = _error(server, path, logit_bias={"3": 1, str(vocab): 2, "-1": 1}, stream=stream)
        assert error["param"] == "logit_bias"
        assert error["message"] == (
            f"token_id(s) [{vocab}, -1] in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab}"
        )
    error = _error(server, path, logit_bias={"hello": 1})
    assert error["param"] == "logit_bias"
    assert (
        error["message"]
        == "logit_bias contains key(s) that cannot be converted to integer token IDs: ['hello']"
    )
    error = _error(server, path, allowed_token_ids=[])
    assert (error["param"], error["message"]) == (
        "allowed_token_ids",
        "allowed_token_ids is not None and empty!",
    )
    error = _error(server, path, allowed_token_ids=[1, vocab])
    assert (error["param"], error["message"]) == (
        "allowed_token_ids",
        "allowed_token_ids contains out-of-vocab token id!",
    )
    error = _error(server, path, bad_words=["ok", "  "])
    assert error["param"] == "bad_words" and "empty or blank" in error["message"]
    error = _error(server, path, bad_words=["\ud800"])  # valid JSON, no tokenizer takes it
    assert error["param"].startswith("bad_words")  # the body's validation or SamplingParams' own
    error = _error(server, path, bad_words=["x"] * 1025)
    assert error["param"] == "bad_words"
    error = _error(server, path, logit_bias={"1": "2"})  # a string is never a number
    assert "logit_bias" in error["message"]


def test_the_openai_client_sees_the_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError, match="in logit_bias contain out-of-vocab token ids"):
        client.completions.create(model="sql", prompt="hi", max_tokens=2, logit_bias={"10000000": 5})
    # The server keeps serving the others.
    assert _generate(client, "sql", True, logit_bias={"5": 100})[0].token_ids == [5] * 16
