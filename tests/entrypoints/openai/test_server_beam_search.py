"""Beam search through the server (real engine, tiny Llama, a PEFT adapter), as vLLM serves it:
`use_beam_search` with n (and best_of) beams on both endpoints, the n choices best first and equal to
transformers' / PEFT's `generate(num_beams=...)`; completions answer stream=true in one JSON body
(vLLM does not stream beam search), chat streams the final beams; what beam search cannot honour is
a 400 naming the field."""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
import torch
from support.beam_reference import hf_beams
from support.harness import RunningServer

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

NUM_NEW = 8
PROMPTS = [[5, 17, 42, 99, 7], [300, 12, 8, 61, 250, 33, 9, 14, 77, 120, 4, 18, 200, 41, 3, 66, 90]]


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    adapter = str(tmp_path_factory.mktemp("beam-adapters") / "sql")
    base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    save_peft_adapter(
        base,
        adapter,
        600,
        model_dir,
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"],
    )
    oracle = PeftModel.from_pretrained(
        AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32), adapter, adapter_name="sql"
    ).eval()
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            device="cpu",
            max_model_len=96,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            kv_cache_memory_bytes=16 << 20,
        )
    )
    options = ServerOptions(served_model_names=["tiny"], lora_modules=[LoRAModulePath("sql", adapter)])
    with RunningServer(engine, options) as server:
        yield {"server": server, "oracle": oracle}


def _reference(oracle: Any, model: str, prompt: list[int], width: int, **kwargs: Any) -> list[list[int]]:
    if model == "tiny":
        with oracle.disable_adapter():
            return [ids for ids, _ in hf_beams(oracle, prompt, width, NUM_NEW, **kwargs)]
    oracle.set_adapter(model)
    return [ids for ids, _ in hf_beams(oracle, prompt, width, NUM_NEW, **kwargs)]


def _client(stack: Any) -> openai.OpenAI:
    return openai.OpenAI(base_url=stack["server"].url + "/v1", api_key="x", max_retries=0)


@pytest.mark.parametrize("model", ["tiny", "sql"])
def test_completions_return_n_beams_best_first(stack: Any, model: str) -> None:
    client = _client(stack)
    result = client.completions.create(
        model=model,
        prompt=PROMPTS,
        max_tokens=NUM_NEW,
        n=3,
        extra_body={"use_beam_search": True, "best_of": 3, "length_penalty": 0.8, "return_token_ids": True},
    )
    assert len(result.choices) == 3 * len(PROMPTS)
    for i, prompt in enumerate(PROMPTS):
        choices = [c for c in result.choices if c.index // 3 == i]
        assert [c.index for c in choices] == [3 * i, 3 * i + 1, 3 * i + 2]
        expected = _reference(stack["oracle"], model, prompt, 3, length_penalty=0.8)
        assert [c.model_extra["token_ids"] for c in choices] == expected
        assert all(c.text and c.finish_reason in ("stop", "length") for c in choices)
    assert result.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in result.choices)


def test_best_of_searches_wider_and_returns_n(stack: Any) -> None:
    result = _client(stack).completions.create(
        model="sql",
        prompt=PROMPTS[0],
        max_tokens=NUM_NEW,
        n=2,
        extra_body={"use_beam_search": True, "best_of": 4, "early_stopping": True, "return_token_ids": True},
    )
    expected = _reference(stack["oracle"], "sql", PROMPTS[0], 4, early_stopping=True)
    assert [c.model_extra["token_ids"] for c in result.choices] == expected[:2]


def test_chat_beams_and_their_stream(stack: Any) -> None:
    client = _client(stack)
    messages = [{"role": "user", "content": "Write SQL for the shipped orders"}]
    extra = {"use_beam_search": True}
    full = client.chat.completions.create(
        model="sql", messages=messages, max_tokens=NUM_NEW, n=2, extra_body=extra
    )
    assert [c.index for c in full.choices] == [0, 1]
    texts = {0: "", 1: ""}
    finished = set()
    for chunk in client.chat.completions.create(
        model="sql", messages=messages, max_tokens=NUM_NEW, n=2, stream=True, extra_body=extra
    ):
        for choice in chunk.choices:  # one choice per chunk
            texts[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert [texts[0], texts[1]] == [c.message.content for c in full.choices]


def test_completions_stream_answers_one_body(stack: Any) -> None:
    """vLLM does not stream beam search on /v1/completions: stream=true gets the whole response."""
    body = {
        "model": "tiny",
        "prompt": PROMPTS[0],
        "max_tokens": NUM_NEW,
        "n": 2,
        "use_beam_search": True,
        "stream": True,
        "return_token_ids": True,
    }
    response = stack["server"].http.post("/v1/completions", json=body, timeout=60)
    assert response.status_code == 200 and response.headers["content-type"].startswith("application/json")
    choices = json.loads(response.text)["choices"]
    assert [c["token_ids"] for c in choices] == _reference(stack["oracle"], "tiny", PROMPTS[0], 2)


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"use_beam_search": True, "n": 3, "best_of": 2}, "best_of"),
        ({"use_beam_search": True, "stop": ["x"]}, "stop"),
        ({"use_beam_search": True, "logprobs": 2}, "logprobs"),
        ({"use_beam_search": True, "min_tokens": 2}, "min_tokens"),
        ({"use_beam_search": True, "response_format": {"type": "json_object"}}, "response_format"),
        ({"best_of": 2}, "best_of"),
        ({"use_beam_search": True, "early_stopping": "sometimes"}, "early_stopping"),
        ({"use_beam_search": True, "length_penalty": "long"}, "length_penalty"),
    ],
)
def test_what_beam_search_cannot_honour_is_a_400(stack: Any, extra: dict[str, Any], param: str) -> None:
    body = {"model": "tiny", "prompt": "hello", "max_tokens": 4, **extra}
    response = stack["server"].http.post("/v1/completions", json=body)
    assert response.status_code == 400, response.text
    assert param in (response.json()["error"].get("param") or "") + response.json()["error"]["message"]


def test_sampling_requests_ignore_beam_only_fields(stack: Any) -> None:
    """As vLLM: length_penalty and early_stopping only matter with use_beam_search."""
    body = {
        "model": "tiny",
        "prompt": "hello",
        "max_tokens": 3,
        "temperature": 0,
        "length_penalty": 2.0,
        "early_stopping": "never",
        "best_of": 1,
    }
    plain = {"model": "tiny", "prompt": "hello", "max_tokens": 3, "temperature": 0}
    http = stack["server"].http
    first, second = http.post("/v1/completions", json=body), http.post("/v1/completions", json=plain)
    assert first.status_code == second.status_code == 200
    assert first.json()["choices"][0]["text"] == second.json()["choices"][0]["text"]
