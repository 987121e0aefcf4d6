"""DoRA adapters (PEFT's use_dora) served unmerged in mixed batches, against PEFT's own DoRA forward:
DoRA and plain adapters and base requests in one batch, on the C kernel (the decoder stack leaves DoRA
steps to the layer loop) and the torch ops, in float32 and bfloat16, on a model without biases
(Llama) and one with qkv biases (Qwen2); and the refusals: a per-request scale or a mix of a DoRA
adapter, whose output scale is not linear in the adapter's strength."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
from support.peft_oracle import Case, logprob_error, peft_logprobs

from loraserve import LLM, SamplingParams
from loraserve.demo.random_model import save_peft_adapter
from loraserve.errors import LoRAAdapterError
from loraserve.lora.request import LoRARequest

ADAPTERS: dict[str, dict[str, Any]] = {
    "dora_all": dict(
        r=8,
        lora_alpha=16,
        use_dora=True,
        target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    ),
    "dora_qv": dict(r=4, lora_alpha=8, use_dora=True, target_modules=["q_proj", "v_proj"]),
    "plain": dict(r=4, lora_alpha=8, target_modules=["q_proj", "up_proj"]),
}
IDS = {name: i + 1 for i, name in enumerate(ADAPTERS)}
CASES: list[Case] = [("dora_all", 1.0), (None, 1.0), ("plain", 1.0), ("dora_qv", 1.0), ("dora_all", 1.0)]
TOLERANCE = {"float32": 1e-4, "bfloat16": 0.03}


def _adapters(arch: str, tiny_model: Any, hf_model: Any, root: Any) -> tuple[str, dict[str, str]]:
    path = tiny_model(arch)
    paths = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        paths[name] = str(root / f"{arch}-{name}")
        save_peft_adapter(hf_model(path), paths[name], seed=300 + i, base_name=path, **kwargs)
    return path, paths


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
def test_dora_in_a_mixed_batch_matches_peft(
    tiny_model: Any,
    hf_model: Any,
    tmp_path: Any,
    arch: str,
    dtype: str,
    cpu_kernel: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    path, paths = _adapters(arch, tiny_model, hf_model, tmp_path)
    llm = LLM(path, dtype=dtype, enable_lora=True, max_loras=3, max_lora_rank=8, enable_prefix_caching=False)
    prompts = [[(11 * i + 5 * j) % 400 + 3 for j in range(6 + i)] for i in range(len(CASES))]
    params = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True, prompt_logprobs=0, logprobs=0)
    requests = [None if n is None else LoRARequest(str(n), IDS[str(n)], paths[str(n)]) for n, _ in CASES]
    outputs = llm.generate(
        [{"prompt_token_ids": p} for p in prompts], params, lora_request=requests, use_tqdm=False
    )
    for out, prompt, case in zip(outputs, prompts, CASES, strict=True):
        ids = prompt + list(out.outputs[0].token_ids)
        error, gap = logprob_error(out, prompt, peft_logprobs(path, paths, case, ids))
        assert error <= TOLERANCE[dtype], f"{arch} {case}: {error:.5f}"
        if dtype == "float32":
            assert gap <= 1e-4


def _without_dora(src: str, dst: str) -> str:
    """The same A and B as a plain LoRA (no magnitude, use_dora off): what serving DoRA wrongly would give."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    weights = os.path.join(dst, "adapter_model.safetensors")
    save_file({k: v for k, v in load_file(weights).items() if "lora_magnitude_vector" not in k}, weights)
    config_path = os.path.join(dst, "adapter_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["use_dora"] = False
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return dst


def test_the_dora_scale_matters(tiny_model: Any, hf_model: Any, tmp_path: Any) -> None:
    """PEFT's DoRA and the same weights as plain LoRA differ well beyond the parity tolerance here, so
    the parity above is DoRA's."""
    path, paths = _adapters("llama", tiny_model, hf_model, tmp_path)
    plain = _without_dora(paths["dora_all"], str(tmp_path / "plain-copy"))
    ids = [5, 17, 33, 90, 4, 61, 250, 7]
    dora = peft_logprobs(path, paths, ("dora_all", 1.0), ids)
    lora = peft_logprobs(path, {"copy": plain}, ("copy", 1.0), ids)
    assert (dora - lora).abs().max().item() > 100 * TOLERANCE["float32"]


def test_dora_adapters_cannot_be_scaled_or_mixed(tiny_model: Any, hf_model: Any, tmp_path: Any) -> None:
    path, paths = _adapters("llama", tiny_model, hf_model, tmp_path)
    llm = LLM(path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=16)
    prompt, params = {"prompt_token_ids": [5, 6, 7]}, SamplingParams(max_tokens=1)
    dora = LoRARequest("dora_qv", 2, paths["dora_qv"])
    with pytest.raises(LoRAAdapterError, match="is a DoRA adapter, whose output scale .* cannot be scaled"):
        llm.generate(
            prompt,
            params,
            lora_request=LoRARequest("dora_qv", 2, paths["dora_qv"], scale=0.5),
            use_tqdm=False,
        )
    mix = LoRARequest.mixed([(dora, 0.5), (LoRARequest("plain", 3, paths["plain"]), 0.5)], 40)
    with pytest.raises(
        LoRAAdapterError, match="'dora_qv' is a DoRA adapter, and DoRA adapters cannot be mixed"
    ):
        llm.generate(prompt, params, lora_request=mix, use_tqdm=False)
    assert len(llm.generate(prompt, params, lora_request=dora, use_tqdm=False)[0].outputs[0].token_ids) == 1
