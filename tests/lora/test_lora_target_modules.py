"""--lora-target-modules (vLLM's): LoRA only on the named modules; an adapter's other weights are skipped,
so it runs exactly as the same adapter cut down to those modules would."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import pytest
import safetensors.torch

from loraserve import LLM, SamplingParams
from loraserve.lora.request import LoRARequest

PARAMS = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, logprobs=0)
PROMPT = {"prompt_token_ids": list(range(20, 44))}


def _cut_down(src: str, dst: str, keep: str) -> str:
    """A copy of the adapter at `src` holding only the weights (and config targets) of module `keep`."""
    shutil.copytree(src, dst)
    path = os.path.join(dst, "adapter_model.safetensors")
    tensors = {k: v for k, v in safetensors.torch.load_file(path).items() if f".{keep}." in k}
    safetensors.torch.save_file(tensors, path)
    config_path = os.path.join(dst, "adapter_config.json")
    with open(config_path, encoding="utf-8") as f:
        config = json.load(f)
    config["target_modules"] = [keep]
    with open(config_path, "w", encoding="utf-8") as f:
        json.dump(config, f)
    return dst


def _run(llm: LLM, lora: LoRARequest | None) -> tuple[list[int], list[float]]:
    seq = llm.generate([PROMPT], PARAMS, lora_request=lora, use_tqdm=False)[0].outputs[0]
    return list(seq.token_ids), [next(iter(p.values())).logprob for p in seq.logprobs or []]


def test_only_the_named_modules_take_lora(tiny_model: Any, hf_model: Any, tmp_path: Any) -> None:
    from loraserve.demo.random_model import save_peft_adapter

    model = tiny_model("llama")
    full = str(tmp_path / "full")
    save_peft_adapter(hf_model(model), full, 5, model, r=8, lora_alpha=32,
                      target_modules=["q_proj", "v_proj", "o_proj", "down_proj"])
    o_only = _cut_down(full, str(tmp_path / "o_only"), "o_proj")
    restricted = LLM(model, dtype="float32", enable_lora=True, lora_target_modules=["o_proj"])
    everything = LLM(model, dtype="float32", enable_lora=True)
    tokens, logprobs = _run(restricted, LoRARequest("full", 1, full))
    expected_tokens, expected_logprobs = _run(everything, LoRARequest("o_only", 1, o_only))
    assert tokens == expected_tokens
    assert logprobs == pytest.approx(expected_logprobs, abs=1e-4)
    assert _run(everything, LoRARequest("full", 2, full))[1] != pytest.approx(logprobs, abs=1e-4)


def test_a_module_the_model_cannot_adapt_is_refused_at_startup(tiny_model: Any) -> None:
    with pytest.raises(ValueError, match=r"--lora-target-modules names \['wq'\]"):
        LLM(tiny_model("llama"), dtype="float32", enable_lora=True, lora_target_modules=["o_proj", "wq"])
