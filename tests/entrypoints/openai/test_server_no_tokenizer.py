"""The server without a tokenizer (--skip-tokenizer-init) on a tiny Gemma-2 (transformers backend,
softcapped attention), and the generation config's sampling defaults for fields a request leaves unset."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.fake_engine import FakeEngine
from support.harness import RunningServer
from support.tiny_gemma2 import save_tiny_gemma2

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.protocol import CompletionRequest
from loraserve.entrypoints.openai.serving.serving_completion import OpenAIServingCompletion
from loraserve.entrypoints.openai.serving.serving_models import BaseModelPath, OpenAIServingModels

PROMPT = [5, 17, 42, 99, 7, 8, 9, 10]


@pytest.fixture(scope="module")
def gemma2(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = str(tmp_path_factory.mktemp("gemma2"))
    hf = save_tiny_gemma2(path, 1)
    return path, hf


def test_token_ids_in_and_out_without_a_tokenizer(gemma2: tuple[str, Any]) -> None:
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    path, hf = gemma2
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=path, dtype="float32", device="cpu", skip_tokenizer_init=True)
    )
    with RunningServer(engine, ServerOptions(served_model_names=["gemma"])) as server:
        body = {"model": "gemma", "prompt": PROMPT, "max_tokens": 4, "temperature": 0, "ignore_eos": True,
                "logprobs": 0}
        response = server.http.post("/v1/completions", json=body)
        assert response.status_code == 200, response.text
        choice = response.json()["choices"][0]
        expected = hf.generate(torch.tensor([PROMPT]), max_new_tokens=4, do_sample=False)[0, len(PROMPT):]
        assert choice["text"] == "" and choice["logprobs"]["tokens"] == [f"token_id:{t}" for t in expected.tolist()]
        text = server.http.post("/v1/completions", json={**body, "prompt": "hello"})
        assert text.status_code == 400 and "--skip-tokenizer-init" in text.json()["error"]["message"]
        chat = server.http.post(
            "/v1/chat/completions", json={"model": "gemma", "messages": [{"role": "user", "content": "hi"}]}
        )
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        bad = server.http.post("/v1/completions", json={**body, "bad_words": ["hello"]})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "bad_words"
        assert bad.json()["error"]["message"].startswith("bad_words need a tokenizer")
        allowed = server.http.post("/v1/completions", json={**body, "allowed_token_ids": [int(expected[1])]})
        assert allowed.json()["choices"][0]["logprobs"]["tokens"] == [f"token_id:{int(expected[1])}"] * 4


def test_unset_fields_take_the_generation_config_defaults(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    engine.model_config.sampling_defaults = {"temperature": 0.3, "top_p": 0.8, "top_k": 7, "max_tokens": 99}
    models = OpenAIServingModels(engine, [BaseModelPath("base", "base")])
    serving = OpenAIServingCompletion(engine, models)
    unset = serving.sampling_params(CompletionRequest(prompt="x"), 5, None)
    assert (unset.temperature, unset.top_p, unset.top_k, unset.min_p, unset.max_tokens) == (0.3, 0.8, 7, 0.0, 5)
    explicit = serving.sampling_params(CompletionRequest(prompt="x", temperature=1.0, top_k=-1), 5, None)
    assert (explicit.temperature, explicit.top_p, explicit.top_k) == (1.0, 0.8, -1)
