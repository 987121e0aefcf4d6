"""Per-request scale and adapter mixes over HTTP, through the OpenAI client (extra_body), on the real
engine (tiny Llama, PEFT adapters): `lora_scale`, llama.cpp's `lora` list, `adapters` and the
"name=weight,..." `model` form, all in one concurrent batch, each against PEFT (`set_scale`,
`add_weighted_adapter(combination_type="cat")`) under teacher forcing; the prefix cache kept apart by
scale and mix (usage.prompt_tokens_details); every refusal a 400 naming the field."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import openai
import pytest
import torch
from support.harness import RunningServer, wait_for
from support.peft_oracle import peft_logprobs

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

ADAPTERS = {
    "french": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]),
    "pirate": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "up_proj"]),
    "wide": dict(r=8, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
    "dora": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "o_proj", "up_proj"]),
}
TOL = 2e-3
PROMPT = [5, 17, 33, 90, 4, 61, 250, 7, 12, 19, 3, 44]


@pytest.fixture(scope="module")
def stack(tiny_model: Any, tmp_path_factory: pytest.TempPathFactory):
    from transformers import AutoModelForCausalLM

    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    root = tmp_path_factory.mktemp("scale-mix")
    paths = {}
    for seed, (name, kwargs) in enumerate(ADAPTERS.items()):
        base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        paths[name] = str(root / name)
        save_peft_adapter(base, paths[name], 700 + seed, model_dir, **kwargs)
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=model_dir,
            dtype="float32",
            device="cpu",
            max_model_len=64,
            enable_lora=True,
            max_loras=3,
            max_cpu_loras=8,
            max_lora_rank=16,
            block_size=4,
            enable_prefix_caching=True,
            kv_cache_memory_bytes=16 << 20,
        )
    )
    options = ServerOptions(
        served_model_names=["tiny"],
        lora_modules=[LoRAModulePath(name, path) for name, path in paths.items()],
        frontend=FrontendOptions(enable_prompt_tokens_details=True),
    )
    with RunningServer(engine, options) as server:
        yield {"server": server, "paths": paths, "model_dir": model_dir}


def _client(stack: dict) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=stack["server"].url + "/v1", api_key="x", max_retries=0)


async def _complete(client: openai.AsyncOpenAI, model: str, prompt: list[int], **extra: Any) -> Any:
    body = {"temperature": 0, "ignore_eos": True, "return_tokens_as_token_ids": True, **extra}
    return await client.completions.create(
        model=model, prompt=prompt, max_tokens=5, logprobs=1, extra_body=body
    )


# (model, extra_body, the PEFT case it must equal)
REQUESTS: list[tuple[str, dict[str, Any], Any]] = [
    ("french", {"lora_scale": 0.3}, ("french", 0.3)),
    ("tiny", {}, (None, 1.0)),
    ("french", {}, ("french", 1.0)),
    ("tiny", {"lora": [{"id": 1, "scale": 0.5}, {"id": 0, "scale": 0}]}, ("pirate", 0.5)),
    (
        "tiny",
        {"adapters": [{"name": "french", "weight": 0.7}, {"name": "pirate", "weight": 0.3}]},
        ((("french", 0.7), ("pirate", 0.3)), 1.0),
    ),
    ("french=0.7,pirate=0.3", {"lora_scale": 2.0}, ((("french", 0.7), ("pirate", 0.3)), 2.0)),
    (
        "tiny",
        {"lora": [{"id": 2, "scale": -1.0}, {"id": 1, "scale": 1.5}]},
        ((("wide", -1.0), ("pirate", 1.5)), 1.0),
    ),
    ("pirate=0.25", {}, ("pirate", 0.25)),
    ("dora", {}, ("dora", 1.0)),
]


def test_scales_and_mixes_in_one_batch_match_peft(stack: dict) -> None:
    async def run_all() -> list[Any]:
        client = _client(stack)
        return await asyncio.gather(*(_complete(client, m, PROMPT, **extra) for m, extra, _ in REQUESTS))

    responses = stack["server"].call(run_all)
    for response, (model, extra, case) in zip(responses, REQUESTS, strict=True):
        assert response.model == model
        logprobs = response.choices[0].logprobs
        tokens = [int(t.removeprefix("token_id:")) for t in logprobs.tokens]
        reference = peft_logprobs(stack["model_dir"], stack["paths"], case, PROMPT + tokens)
        for i, (token, logprob) in enumerate(zip(tokens, logprobs.token_logprobs, strict=True)):
            row = reference[len(PROMPT) - 1 + i]
            assert row[token] >= row.max() - TOL, f"{model} {extra}: token {i} is not PEFT's argmax"
            assert abs(row[token].item() - logprob) < TOL, f"{model} {extra}: logprob {i} differs from PEFT's"


def test_prefix_cache_is_kept_apart_by_scale_and_mix(stack: dict) -> None:
    prompt = [9, 8, 7, 6, 5, 4, 3, 2, 100, 101, 102, 103, 104]

    def cached(model: str, **extra: Any) -> int:
        response = stack["server"].call(lambda: _complete(_client(stack), model, prompt, **extra))
        details = response.usage.prompt_tokens_details
        return 0 if details is None else details.cached_tokens

    assert cached("french", lora_scale=0.5) == 0
    assert cached("french", lora_scale=0.5) == 12
    assert cached("french", lora_scale=0.75) == 0
    assert cached("french=0.5,pirate=0.5") == 0
    assert (
        cached("tiny", adapters=[{"name": "french", "weight": 0.5}, {"name": "pirate", "weight": 0.5}]) == 12
    )
    assert cached("french=0.5,pirate=0.25") == 0
    assert cached("french=0.5") == 12  # one adapter at a weight is that adapter at that scale


@pytest.mark.parametrize(
    "model,extra,param,text",
    [
        (
            "french",
            {"lora_scale": 9},
            "lora_scale",
            r"lora_scale must be a finite number within \[-4, 4\], got 9",
        ),
        ("tiny", {"lora_scale": 0.5}, "lora_scale", "the request selects the base model"),
        (
            "tiny",
            {"lora": [{"id": 7, "scale": 1.0}]},
            "lora",
            "No LoRA adapter has id 7: this server lists 4",
        ),
        ("french", {"lora": [{"id": 0, "scale": 1.0}]}, "model", "set 'model' to the base model"),
        ("tiny", {"adapters": [{"name": "tiny", "weight": 1.0}]}, "adapters", "names the base model"),
        ("tiny", {"adapters": [{"name": "french", "weight": 0.5}], "lora": []}, "lora", "not both"),
        ("tiny", {"adapters": []}, "adapters", "names no adapter"),
        ("french=abc", {}, "model", "is not a number"),
        ("french=1,french=2", {}, "model", "names an adapter twice"),
        ("french=0.5,pirate=5", {}, "model", r"the weight .* within \[-4, 4\]"),
        (
            "french=1,pirate=1,wide=1",
            {},
            "model",
            r"total rank at .* is 20 \(8 \+ 4 \+ 8\), above --max-lora-rank=16",
        ),
        ("dora", {"lora_scale": 0.5}, "model", "is a DoRA adapter, whose output scale .* cannot be scaled"),
        ("dora=0.5,pirate=0.5", {}, "model", "'dora' is a DoRA adapter, and DoRA adapters cannot be mixed"),
    ],
)
def test_bad_selections_are_refused_with_400(
    stack: dict, model: str, extra: dict, param: str, text: str
) -> None:
    body = {"model": model, "prompt": PROMPT, "max_tokens": 2, **extra}
    response = stack["server"].http.post("/v1/completions", json=body, timeout=30)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert re.search(text, error["message"]), error
    if param != "model" or not any(word in text for word in ("rank", "DoRA")):
        assert error["param"] == param
    # The server goes on serving.
    assert (
        stack["server"]
        .http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, "max_tokens": 1}, timeout=30)
        .status_code
        == 200
    )


def test_lora_adapters_lists_the_ids_lora_entries_use(stack: dict) -> None:
    listed = stack["server"].http.get("/lora-adapters").json()
    assert listed == [
        {"id": 0, "name": "french", "scale": 1.0},
        {"id": 1, "name": "pirate", "scale": 1.0},
        {"id": 2, "name": "wide", "scale": 1.0},
        {"id": 3, "name": "dora", "scale": 1.0},
    ]
    models = [card["id"] for card in stack["server"].http.get("/v1/models").json()["data"]]
    assert models == ["tiny", "french", "pirate", "wide", "dora"]  # the same order, after the base model


def test_chat_takes_the_same_fields(stack: dict) -> None:
    client = openai.OpenAI(base_url=stack["server"].url + "/v1", api_key="x", max_retries=0)
    messages = [{"role": "user", "content": "hello"}]

    def tokens(model: str, **extra: Any) -> list[str]:
        response = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=4,
            temperature=0,
            logprobs=True,
            extra_body={"ignore_eos": True, "return_tokens_as_token_ids": True, **extra},
        )
        return [t.token for t in response.choices[0].logprobs.content]

    mix = [{"name": "french", "weight": 0.7}, {"name": "pirate", "weight": 0.3}]
    assert tokens("tiny", adapters=mix) == tokens("french=0.7,pirate=0.3")
    assert tokens("french", lora_scale=0.0) == tokens("tiny")


def test_metrics_label_weighted_models_by_served_names(stack: dict) -> None:
    """A client's weights must not become label values: each weight would be a series of its own."""
    server = stack["server"]
    for model in ("french=0.61,pirate=0.39", "pirate=0.37"):
        body = {"model": model, "prompt": PROMPT, "max_tokens": 1}
        assert server.http.post("/v1/completions", json=body, timeout=30).status_code == 200
    text = server.http.get("/metrics").text
    # The series (name and labels) only: a sample's value, a latency say, may well read 0.37...
    series = [line.partition(" ")[0] for line in text.splitlines()]
    assert [name for name in series if "0.61" in name or "0.37" in name] == []
    assert 'model_name="pirate"' in text


def test_forgotten_mixes_leave_the_engine(stack: dict, monkeypatch: pytest.MonkeyPatch) -> None:
    """The server remembers the newest MAX_MIXES mixes; older ones are unregistered from the engine, so
    clients sending ever new weights cannot grow the engine's registry without bound."""
    from loraserve.entrypoints.openai.serving import serving_models

    monkeypatch.setattr(serving_models, "MAX_MIXES", 2)
    server = stack["server"]

    def mixes() -> set[str]:
        listed = server.call(lambda: server.engine.list_loras())
        return {r.lora_name for r in listed if r.is_mix}

    before = mixes()
    names = [f"french={w},pirate=0.5" for w in ("0.11", "0.12", "0.13", "0.14")]
    for name in names:
        body = {"model": name, "prompt": PROMPT, "max_tokens": 1}
        assert server.http.post("/v1/completions", json=body, timeout=30).status_code == 200
    wait_for(lambda: not (mixes() - before) & set(names[:2]), 30, "the forgotten mixes to be removed")
    assert set(names[2:]) <= mixes()
    # A forgotten mix asked again is served again (under a new id).
    body = {"model": names[0], "prompt": PROMPT, "max_tokens": 1}
    assert server.http.post("/v1/completions", json=body, timeout=30).status_code == 200
