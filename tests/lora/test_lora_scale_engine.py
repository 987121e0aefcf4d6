"""Per-request LoRA scale through the engine (`LoRARequest(..., scale=)`) against PEFT's `set_scale` (tests/support/peft_oracle.py):
one adapter at several scales, a plain adapter and base requests in one batch, on the C kernel and the
torch ops, in float32 and bfloat16; and the prefix cache, which never shares KV across scales."""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from support.peft_oracle import logprob_error, peft_logprobs

from loraserve import LLM, SamplingParams
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.demo.random_model import save_peft_adapter
from loraserve.lora.request import LoRARequest

ADAPTERS: dict[str, dict[str, Any]] = {
    "all7": dict(
        r=8,
        lora_alpha=16,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
}
NUM_NEW = 6
# (adapter, scale) per request of the batch: base, a plain adapter, and "all7" at four scales.
CASES: list[tuple[str | None, float]] = [
    ("all7", 0.3),
    (None, 1.0),
    ("all7", 1.0),
    ("qv", 1.0),
    ("all7", -0.5),
    ("all7", 2.0),
    ("qv", 0.5),
]


@pytest.fixture(scope="module")
def adapters(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    path = tiny_model("llama")
    root = tmp_path_factory.mktemp("scale-adapters")
    paths = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / name)
        # Larger B than PEFT's zero init (save_peft_adapter's seed): the adapters move logprobs visibly.
        save_peft_adapter(hf_model(path), paths[name], seed=70 + i, base_name=path, **kwargs)
    return paths


def _prompts(count: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randint(3, 500, (int(n),), generator=g).tolist()
        for n in torch.randint(4, 20, (count,), generator=g)
    ]


def _run(llm: LLM, adapters: dict[str, str], prompts: list[list[int]]) -> list[Any]:
    ids = {name: i + 1 for i, name in enumerate(adapters)}
    requests = [None if n is None else LoRARequest(n, ids[n], adapters[n], scale=s) for n, s in CASES]
    params = SamplingParams(
        temperature=0.0, max_tokens=NUM_NEW, ignore_eos=True, prompt_logprobs=0, logprobs=0
    )
    return llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False
    )


# float32: the engine's logprobs match PEFT's to 1e-4; bf16 keeps 8 bits (see test_engine_lora.py).
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.03}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
def test_scales_in_one_batch_match_peft_set_scale(
    tiny_model: Any, adapters: dict[str, str], dtype: str, cpu_kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    scaled_steps: list[bool] = []
    build = LoRABatchMapping.build

    def recording(cls: type, *args: Any, **kwargs: Any) -> LoRABatchMapping:
        mapping = build(*args, **kwargs)
        scaled_steps.append(mapping.scales is not None)
        return mapping

    monkeypatch.setattr(LoRABatchMapping, "build", classmethod(recording))
    path = tiny_model("llama")
    prompts = _prompts(len(CASES))
    llm = LLM(path, dtype=dtype, enable_lora=True, max_loras=2, max_lora_rank=8, enable_prefix_caching=False)
    outputs = _run(llm, adapters, prompts)
    assert any(scaled_steps)  # the steps really carried per-token scales
    for out, prompt, case in zip(outputs, prompts, CASES, strict=True):
        ids = prompt + list(out.outputs[0].token_ids)
        error, gap = logprob_error(out, prompt, peft_logprobs(path, adapters, case, ids))
        assert error <= TOLERANCE[dtype], f"{case}: {error:.5f}"
        if dtype == "float32":  # and greedy: each generated token is PEFT's argmax
            assert gap <= 1e-4


def test_scale_changes_the_output_and_one_is_the_plain_adapter(
    tiny_model: Any, adapters: dict[str, str]
) -> None:
    """Scale 0 is the base model, 1 the adapter as loaded, and other scales differ from both."""
    path = tiny_model("llama")
    llm = LLM(
        path, dtype="float32", enable_lora=True, max_loras=1, max_lora_rank=8, enable_prefix_caching=False
    )
    prompt = {"prompt_token_ids": _prompts(1, seed=3)[0]}
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0)

    def logprobs(lora: LoRARequest | None) -> list[float]:
        out = llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
        ids = prompt["prompt_token_ids"]
        return [out.prompt_logprobs[p][ids[p]].logprob for p in range(1, len(ids))]

    base, plain = logprobs(None), logprobs(LoRARequest("all7", 1, adapters["all7"]))
    zero = logprobs(LoRARequest("all7", 1, adapters["all7"], scale=0.0))
    one = logprobs(LoRARequest("all7", 1, adapters["all7"], scale=1.0))
    half = logprobs(LoRARequest("all7", 1, adapters["all7"], scale=0.5))
    assert one == plain and all(math.isclose(a, b, abs_tol=1e-5) for a, b in zip(zero, base, strict=True))
    assert max(abs(a - b) for a, b in zip(half, plain, strict=True)) > 1e-3
    assert max(abs(a - b) for a, b in zip(half, base, strict=True)) > 1e-3


def test_prefix_cache_keeps_scales_apart(tiny_model: Any, adapters: dict[str, str]) -> None:
    """A prompt cached at one scale is a miss at another and a hit at the same one; scale 1.0 shares
    with requests that set none (the same computation)."""
    path = tiny_model("llama")
    llm = LLM(
        path,
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        block_size=4,
        enable_prefix_caching=True,
    )
    prompt = {"prompt_token_ids": list(range(10, 30))}
    params = SamplingParams(temperature=0.0, max_tokens=1)

    def cached(scale: float | None) -> int:
        lora = (
            LoRARequest("all7", 1, adapters["all7"])
            if scale is None
            else LoRARequest("all7", 1, adapters["all7"], scale=scale)
        )
        out = llm.generate(prompt, params, lora_request=lora, use_tqdm=False)[0]
        assert out.num_cached_tokens is not None
        return out.num_cached_tokens

    assert cached(0.5) == 0
    assert cached(0.5) == 16  # whole blocks of 4 before the last token
    assert cached(0.25) == 0
    assert cached(None) == 0
    assert cached(1.0) == 16
    assert cached(0.25) == 16


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), 4.5, -5.0, True, "0.5"])
def test_lora_request_refuses_bad_scales(bad: object) -> None:
    with pytest.raises(ValueError, match=r"scale must be a finite number within \[-4, 4\]"):
        LoRARequest("a", 1, "/nowhere", scale=bad)  # type: ignore[arg-type]


@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
def test_a_scale_scales_the_adapter_bias_too(
    tiny_model: Any, hf_model: Any, tmp_path: Any, cpu_kernel: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PEFT's set_scale multiplies lora_B's output, its bias included: so does a request's scale."""
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    path = tiny_model("llama")
    adapter = str(tmp_path / "bias")
    save_peft_adapter(
        hf_model(path),
        adapter,
        seed=77,
        base_name=path,
        r=4,
        lora_alpha=8,
        target_modules=["q_proj", "o_proj", "down_proj"],
        lora_bias=True,
    )
    llm = LLM(
        path,
        dtype="float32",
        enable_lora=True,
        max_loras=1,
        max_lora_rank=8,
        enable_lora_bias=True,
        enable_prefix_caching=False,
    )
    prompts = _prompts(3, seed=5)
    scales = [0.5, 1.0, -1.5]
    params = SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts],
        params,
        use_tqdm=False,
        lora_request=[LoRARequest("bias", 1, adapter, scale=s) for s in scales],
    )
    for out, prompt, scale in zip(outputs, prompts, scales, strict=True):
        ids = prompt + list(out.outputs[0].token_ids)
        error, _ = logprob_error(out, prompt, peft_logprobs(path, {"bias": adapter}, ("bias", scale), ids))
        assert error <= 1e-4, f"scale {scale}: {error:.5f}"
