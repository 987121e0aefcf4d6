"""Adapter mixes through the engine (`LoRARequest.mixed`) against PEFT's `add_weighted_adapter(
combination_type="cat")`: mixes of adapters with different ranks, scalings and target modules, in one
batch with base requests, plain and scaled adapters and a scaled mix, on the C kernel and the torch
ops, in float32 and bfloat16; the rank limit; and the prefix cache, keyed by the mix."""

from __future__ import annotations

from typing import Any

import pytest
from support.peft_oracle import Case, logprob_error, peft_logprobs

from loraserve import LLM, SamplingParams
from loraserve.demo.random_model import save_peft_adapter
from loraserve.errors import LoRAAdapterError
from loraserve.lora.request import LoRARequest

ADAPTERS: dict[str, dict[str, Any]] = {
    "all7": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "qv": dict(r=4, lora_alpha=8, use_rslora=True, target_modules=["q_proj", "v_proj"]),
    "mlp": dict(r=4, lora_alpha=16, target_modules=["gate_proj", "down_proj"]),
}
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}
MIX_A = (("all7", 0.7), ("qv", 0.3))
MIX_B = (("qv", -0.5), ("mlp", 1.5), ("all7", 0.25))  # 16 ranks: at --max-lora-rank
CASES: list[Case] = [
    (MIX_A, 1.0),
    (None, 1.0),
    ("all7", 1.0),
    (MIX_B, 1.0),
    ("qv", 0.5),
    (MIX_A, 0.5),
    ("mlp", 1.0),
]
NUM_NEW = 6
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.03}


@pytest.fixture(scope="module")
def adapters(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    path = tiny_model("llama")
    root = tmp_path_factory.mktemp("mix-adapters")
    paths = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        save_peft_adapter(hf_model(path), paths[name], seed=90 + i, base_name=path, **kwargs)
    return paths


def _request(adapters: dict[str, str], case: Case, mix_ids: dict[Any, int]) -> LoRARequest | None:
    target, scale = case
    if target is None:
        return None
    if isinstance(target, str):
        return LoRARequest(target, IDS[target], adapters[target], scale=scale)
    parts = [(LoRARequest(n, IDS[n], adapters[n]), w) for n, w in target]
    mix = LoRARequest.mixed(parts, mix_ids.setdefault(target, 100 + len(mix_ids)))
    return LoRARequest(mix.lora_name, mix.lora_id, mix.lora_path, mix=mix.mix, scale=scale)


def _prompts(count: int) -> list[list[int]]:
    return [[(7 * i + 13 * j) % 480 + 3 for j in range(5 + 2 * i)] for i in range(count)]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
def test_mixes_in_one_batch_match_peft_cat(
    tiny_model: Any, adapters: dict[str, str], dtype: str, cpu_kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    path = tiny_model("llama")
    prompts = _prompts(len(CASES))
    llm = LLM(path, dtype=dtype, enable_lora=True, max_loras=4, max_lora_rank=16, enable_prefix_caching=False)
    mix_ids: dict[Any, int] = {}
    requests = [_request(adapters, case, mix_ids) for case in CASES]
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False
    )
    for out, prompt, case in zip(outputs, prompts, CASES, strict=True):
        ids = prompt + list(out.outputs[0].token_ids)
        error, gap = logprob_error(out, prompt, peft_logprobs(path, adapters, case, ids))
        assert error <= TOLERANCE[dtype], f"{case}: {error:.5f}"
        if dtype == "float32":
            assert gap <= 1e-4, f"{case}: a generated token PEFT ranks {gap:.5f} below its best"


def test_mix_above_the_rank_limit_is_refused_naming_it(tiny_model: Any, adapters: dict[str, str]) -> None:
    llm = LLM(tiny_model("llama"), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8)
    parts = [(LoRARequest(n, IDS[n], adapters[n]), 0.5) for n in ("all7", "qv")]
    with pytest.raises(LoRAAdapterError, match=r"total rank at .* is 12 \(8 \+ 4\), above --max-lora-rank=8"):
        llm.generate(
            {"prompt_token_ids": [5, 6, 7]},
            SamplingParams(max_tokens=1),
            lora_request=LoRARequest.mixed(parts, 50),
            use_tqdm=False,
        )
    # The server goes on: a mix that fits, and its components alone, still run.
    fits = LoRARequest.mixed(
        [(LoRARequest("qv", 2, adapters["qv"]), 1.0), (LoRARequest("mlp", 3, adapters["mlp"]), 1.0)], 51
    )
    out = llm.generate(
        {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=2), lora_request=fits, use_tqdm=False
    )
    assert len(out[0].outputs[0].token_ids) == 2


@pytest.mark.parametrize(
    "bad,match",
    [
        ([], "names 1 to 8 adapters, got 0"),
        ([("a", 1), ("a", 0.5)], "names an adapter twice"),
        ([("a", float("nan"))], r"the weight of 'a' must be a finite number within \[-4, 4\]"),
        ([(f"n{i}", 0.1) for i in range(9)], "names 1 to 8 adapters, got 9"),
    ],
)
def test_mix_requests_refuse_bad_parts(bad: list[tuple[str, float]], match: str) -> None:
    ids = {name: i + 1 for i, name in enumerate(dict.fromkeys(n for n, _ in bad))}
    parts = [(LoRARequest(n, ids[n], f"/p/{n}"), w) for n, w in bad]
    with pytest.raises(ValueError, match=match):
        LoRARequest.mixed(parts, 99)


def test_prefix_cache_is_keyed_by_the_mix(tiny_model: Any, adapters: dict[str, str]) -> None:
    """The same mix shares its KV; other weights of the same adapters, or the mix at another scale, do not."""
    llm = LLM(
        tiny_model("llama"),
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=16,
        block_size=4,
        enable_prefix_caching=True,
    )
    prompt = {"prompt_token_ids": list(range(40, 60))}
    params = SamplingParams(temperature=0.0, max_tokens=1)
    mix_ids: dict[Any, int] = {}

    def cached(case: Case) -> int:
        out = llm.generate(prompt, params, lora_request=_request(adapters, case, mix_ids), use_tqdm=False)[0]
        assert out.num_cached_tokens is not None
        return out.num_cached_tokens

    assert cached((MIX_A, 1.0)) == 0
    assert cached((MIX_A, 1.0)) == 16
    assert cached(((("all7", 0.3), ("qv", 0.7)), 1.0)) == 0
    assert cached((MIX_A, 0.5)) == 0
    assert cached(("all7", 1.0)) == 0
    assert cached((MIX_A, 1.0)) == 16
