"""Adapters on the vocab modules over HTTP through the OpenAI client, on the real engine (tiny Llama):
an adapter with LoRA on embed_tokens and lm_head, one with trainable tokens and a plain one, in one
concurrent batch, each equal to the offline engine's greedy tokens and to PEFT's logprobs; a scale on
the trainable-token adapter is a 400 naming why; loading an adapter whose trainable_token_indices are
negative, out of the vocabulary, repeated or an empty list is a 400 naming the adapter, the module and
the index, and the server goes on serving."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import openai
import pytest
import torch
from support.harness import RunningServer
from support.peft_oracle import peft_logprobs
from support.vocab_adapters import save_vocab_adapter

from loraserve import LLM, SamplingParams
from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath
from loraserve.lora.request import LoRARequest

ADAPTERS = {
    "vocab": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj"]),
    "tokens": dict(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=[5, 17, 33]),
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]),
}
PROMPT = [5, 17, 33, 90, 4, 61, 250, 7, 12, 19, 3, 44]
TOL = 2e-3


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    root = tmp_path_factory.mktemp("vocab-server")
    paths = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        paths[name] = str(root / name)
        save_vocab_adapter(base, paths[name], 800 + seed, model_dir, **kwargs)
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            device="cpu",
            max_model_len=64,
            enable_lora=True,
            max_loras=2,
            max_lora_rank=8,
            kv_cache_memory_bytes=16 << 20,
        )
    )
    options = ServerOptions(
        served_model_names=["tiny"],
        lora_modules=[LoRAModulePath(n, p) for n, p in paths.items()],
        allow_runtime_lora_updating=True,
    )
    with RunningServer(engine, options) as server:
        yield {"server": server, "paths": paths, "model_dir": model_dir}


def _client(stack: dict) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack["server"].url + "/v1", api_key="x", max_retries=0)


async def _complete(client: openai.AsyncOpenAI, model: str, **extra: Any) -> Any:
    body = {"temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True, **extra}
    return await client.completions.create(
        model=model, prompt=PROMPT, max_tokens=5, logprobs=1, extra_body=body
    )


def test_vocab_adapters_over_http_match_offline_and_peft(stack: dict) -> None:
    models = ["vocab", "tiny", "tokens", "plain", "vocab"]

    async def run_all() -> list[Any]:
        client = _client(stack)
        return await asyncio.gather(*(_complete(client, m) for m in models))

    responses = stack["server"].call(run_all)
    paths, model_dir = stack["paths"], stack["model_dir"]
    llm = LLM(model_dir, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    ids = {name: i + 1 for i, name in enumerate(paths)}
    offline = llm.generate(
        [{"prompt_token_ids": PROMPT}] * len(models),
        SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
        lora_request=[None if m == "tiny" else LoRARequest(m, ids[m], paths[m]) for m in models],
        use_tqdm=False,
    )
    for response, model, out in zip(responses, models, offline, strict=True):
        logprobs = response.choices[0].logprobs
        tokens = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
        assert tokens == list(out.outputs[0].token_ids), model
        reference = peft_logprobs(
            model_dir, paths, (None if model == "tiny" else model, 1.0), PROMPT + tokens
        )
        for i, (token, logprob) in enumerate(zip(tokens, logprobs.token_logprobs, strict=True)):
            assert abs(reference[len(PROMPT) - 1 + i, token].item() - logprob) < TOL, f"{model}: logprob {i}"
    assert [r.choices[0].text for r in responses[:3]] != [responses[1].choices[0].text] * 3  # adapters matter


def test_a_scale_on_trainable_tokens_is_a_400(stack: dict) -> None:
    async def scaled() -> Any:
        return await _complete(_client(stack), "tokens", lora_scale=0.5)

    with pytest.raises(openai.BadRequestError, match="replaces vocab weights"):
        stack["server"].call(scaled)


@pytest.mark.parametrize(
    ("indices", "message"),
    [
        ([5, -17, 33], "trainable_token_indices' in adapter_config.json"),
        ([5, 17, 5], "embed_tokens index 5 (at position 2) is repeated"),
        ({"embed_tokens": [5, 17, 33], "lm_head": []}, "the list of lm_head is empty"),
        (
            [5, 17, 100000],
            "trainable_token_indices of model.embed_tokens: index 100000 (at position 2) is not below "
            "the vocabulary size",
        ),
    ],
)
def test_bad_trainable_token_indices_are_refused_at_load(
    stack: dict, tmp_path: Path, indices: Any, message: str
) -> None:
    folder = tmp_path / "bad-tokens"
    shutil.copytree(stack["paths"]["tokens"], folder)
    config = json.loads((folder / "adapter_config.json").read_text())
    config["trainable_token_indices"] = indices
    (folder / "adapter_config.json").write_text(json.dumps(config))
    http = stack["server"].http
    reply = http.post("/v1/load_lora_adapter", json={"lora_name": "bad-tokens", "lora_path": str(folder)})
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]["message"]
    assert "LoRA adapter 'bad-tokens'" in error and message in error, error
    if isinstance(indices, list) and -17 in indices:
        assert "embed_tokens index -17 (at position 1) is negative" in error
    assert all(card["id"] != "bad-tokens" for card in http.get("/v1/models").json()["data"])
    ok = http.post("/v1/completions", json={"model": "tokens", "prompt": PROMPT, "max_tokens": 2})
    assert ok.status_code == 200, ok.text
