"""Adapters on the vocab modules through the engine, against PEFT (tests/support/peft_oracle.py): LoRA
on embed_tokens and lm_head, trainable tokens (`trainable_token_indices`) and modules_to_save of the
embedding or the head, each request of one mixed batch with its own adapter (more adapters than
max_loras), with per-request scales, on tied and untied models, on the C kernel, the torch ops and
Triton (its interpreter), in float32 and bfloat16; the prefix cache keyed by such an adapter."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.peft_oracle import Case, logprob_error, peft_logprobs
from support.triton_lora import needs_triton, use_triton_lora
from support.vocab_adapters import save_vocab_adapter

from loraserve import LLM, SamplingParams
from loraserve.errors import LoRAAdapterError
from loraserve.lora.request import LoRARequest

# The prompts' tokens are drawn from [3, 60): trainable tokens among them are replaced visibly.
TOKENS = [5, 9, 14, 20, 33, 41]
ADAPTERS: dict[str, dict[str, Any]] = {
    "embhead": dict(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "q_proj", "v_proj"]),
    "emb": dict(r=4, lora_alpha=8, target_modules=["embed_tokens", "o_proj"]),
    "head": dict(r=4, lora_alpha=4, target_modules=["lm_head"]),
    "tokens": dict(r=4, lora_alpha=8, target_modules=["q_proj"], trainable_token_indices=TOKENS),
    "saved_head": dict(r=4, lora_alpha=8, target_modules=["q_proj"], modules_to_save=["lm_head"]),
    "saved_emb": dict(r=4, lora_alpha=8, target_modules=["down_proj"], modules_to_save=["embed_tokens"]),
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
}
CASES: list[Case] = [
    ("embhead", 1.0),
    (None, 1.0),
    ("emb", 1.0),
    ("tokens", 1.0),
    ("embhead", 0.5),
    ("saved_head", 1.0),
    ("plain", 1.0),
    ("head", -1.5),
    ("saved_emb", 1.0),
]
NUM_NEW = 4
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.05}


@pytest.fixture(scope="module", params=["llama", "llama_tied"])
def family(request: pytest.FixtureRequest, tiny_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoModelForCausalLM

    path = tiny_model(request.param)
    root = tmp_path_factory.mktemp(f"vocab-{request.param}")
    paths = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()  # PEFT modifies it
        save_vocab_adapter(base, paths[name], seed=90 + i, base_name=path, **kwargs)
    return path, paths


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 60, (int(n),), generator=g).tolist()
        for n in torch.randint(5, 16, (count,), generator=g)
    ]


def _check_batch(llm: LLM, path: str, adapters: dict[str, str], dtype: str, cases: list[Case]) -> None:
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    requests = [
        None if n is None else LoRARequest(str(n), ids[str(n)], adapters[str(n)], scale=s) for n, s in cases
    ]
    prompts = _prompts(len(cases))
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0
    )
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False
    )
    for out, prompt, case in zip(outputs, prompts, cases, strict=True):
        reference = peft_logprobs(path, adapters, case, prompt + list(out.outputs[0].token_ids))
        error, gap = logprob_error(out, prompt, reference)
        assert error <= TOLERANCE[dtype], f"{case}: {error:.5f}"
        if dtype == "float32":
            assert gap <= 1e-4, f"{case}: greedy token {gap:.5f} below PEFT's best"


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
def test_vocab_adapters_in_one_batch_match_peft(
    family: Any, dtype: str, cpu_kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    path, adapters = family
    llm = LLM(path, dtype=dtype, enable_lora=True, max_loras=3, max_lora_rank=8, enable_prefix_caching=False)
    _check_batch(llm, path, adapters, dtype, CASES)


@needs_triton
def test_vocab_lora_on_triton_matches_peft(family: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    calls = use_triton_lora(monkeypatch)
    path, adapters = family
    llm = LLM(
        path, dtype="float32", enable_lora=True, max_loras=3, max_lora_rank=8, enable_prefix_caching=False
    )
    _check_batch(llm, path, adapters, "float32", [("embhead", 1.0), (None, 1.0), ("emb", 0.5), ("head", 1.0)])
    assert calls


def test_each_term_changes_the_output(family: Any) -> None:
    """Every adapter moves its own requests' logprobs away from the base (so parity is no accident)."""
    path, adapters = family
    llm = LLM(
        path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=8, enable_prefix_caching=False
    )
    prompt = {"prompt_token_ids": TOKENS + [7, 8]}
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs(lora: LoRARequest | None) -> torch.Tensor:
        out = llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
        ids = prompt["prompt_token_ids"]
        return torch.tensor([out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))])

    base = logprobs(None)
    for i, name in enumerate(("emb", "head", "tokens", "saved_head", "saved_emb")):
        moved = (logprobs(LoRARequest(name, i + 1, adapters[name])) - base).abs().max().item()
        assert moved > 1e-3, name


def test_prefix_cache_keys_an_embedding_adapter(family: Any) -> None:
    """KV computed under an embedding adapter is never served to the base or another adapter."""
    path, adapters = family
    llm = LLM(
        path,
        dtype="float32",
        enable_lora=True,
        max_loras=2,
        max_lora_rank=8,
        block_size=4,
        enable_prefix_caching=True,
    )
    prompt = {"prompt_token_ids": list(range(10, 30))}
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def cached(lora: LoRARequest | None) -> int:
        out = llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
        assert out.num_cached_tokens is not None
        return out.num_cached_tokens

    emb = LoRARequest("emb", 1, adapters["emb"])
    assert cached(emb) == 0
    assert cached(emb) == 16
    assert cached(None) == 0
    assert cached(LoRARequest("tokens", 2, adapters["tokens"])) == 0


def test_replacing_adapters_refuse_a_scale_and_a_mix(family: Any) -> None:
    path, adapters = family
    llm = LLM(
        path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, enable_prefix_caching=False
    )
    params = SamplingParams(max_tokens=1)
    tokens = LoRARequest("tokens", 1, adapters["tokens"], scale=0.5)
    with pytest.raises(LoRAAdapterError, match="replaces vocab weights .* cannot be scaled per request"):
        llm.generate({"prompt_token_ids": [5, 6]}, params, lora_request=tokens, use_tqdm=False)
    mix = LoRARequest.mixed(
        [
            (LoRARequest("saved_head", 2, adapters["saved_head"]), 0.5),
            (LoRARequest("plain", 3, adapters["plain"]), 0.5),
        ],
        9,
    )
    with pytest.raises(LoRAAdapterError, match="replaces vocab weights .* cannot be mixed"):
        llm.generate({"prompt_token_ids": [5, 6]}, params, lora_request=mix, use_tqdm=False)


def test_mixing_embedding_lora_matches_peft_cat(family: Any) -> None:
    """A mix concatenates ranks on the vocab modules too, as PEFT's add_weighted_adapter "cat"."""
    path, adapters = family
    llm = LLM(
        path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16, enable_prefix_caching=False
    )
    parts = [
        (LoRARequest("embhead", 1, adapters["embhead"]), 0.7),
        (LoRARequest("emb", 2, adapters["emb"]), 0.3),
    ]
    prompt = _prompts(1, seed=4)[0]
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0
    )
    out = llm.generate(
        {"prompt_token_ids": prompt}, params, lora_request=LoRARequest.mixed(parts, 9), use_tqdm=False
    )[0]
    case: Case = ((("embhead", 0.7), ("emb", 0.3)), 1.0)
    reference = peft_logprobs(path, adapters, case, prompt + list(out.outputs[0].token_ids))
    error, _ = logprob_error(out, prompt, reference)
    assert error <= 1e-4
