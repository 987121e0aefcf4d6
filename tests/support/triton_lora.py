"""Serve a test's LoRA terms through the Triton kernels on CPU, under Triton's interpreter.

`ops.add_lora` picks Triton for CUDA tensors only; on a CPU the parity tests reach the same kernels
under `TRITON_INTERPRET=1` (set by tests/conftest.py before anything imports Triton: `@triton.jit`
reads it when a kernel is defined, Triton's own library included), keeping the C kernel off (`LORASERVE_CPU_LORA_KERNEL=0`) and pointing the ops' backend choice at the module.
The interpreter has no bf16 dot, so these cases run float32 only.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import os
import sys
from types import ModuleType
from typing import Any

import pytest
import torch

TRITON_MISSING = importlib.util.find_spec("triton") is None
needs_triton = pytest.mark.skipif(TRITON_MISSING, reason="needs Triton (run under its interpreter)")
_MODULE = "loraserve.lora.ops.lora_triton"


def _interpreted_module() -> ModuleType:
    from triton.runtime.interpreter import InterpretedFunction

    module = importlib.import_module(_MODULE)
    if not isinstance(module._shrink_kernel, InterpretedFunction):
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set (tests/conftest.py sets it)")
    return module


def use_triton_lora(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """From here to the test's end every LoRA term runs Triton's kernels; returns a list that counts
    (token rows per call) the `add_lora` calls they serve, so a test can assert they ran."""
    from loraserve.lora import ops

    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", "0")
    triton_ops = _interpreted_module()
    calls: list[int] = []
    add_lora = triton_ops.add_lora

    def counted(y, x, a, b, mapping, *args, **kwargs):  # type: ignore[no-untyped-def]
        calls.append(x.shape[0])
        return add_lora(y, x, a, b, mapping, *args, **kwargs)

    monkeypatch.setattr(triton_ops, "add_lora", counted)
    monkeypatch.setattr(ops, "_backend", lambda tensor: triton_ops)
    assert sys.modules[_MODULE] is triton_ops
    return calls


def check_mixed_batch_through_triton(
    monkeypatch: pytest.MonkeyPatch,
    path: str,
    adapters: dict[str, str],
    prompt: list[int],
    scored: dict[str, str] | None = None,
    num_new: int = 2,
    **llm_kwargs: Any,
) -> None:
    """One prompt for the base model and each adapter in one batch, over fewer slots than adapters, with
    every LoRA term `ops.add_lora` serves through Triton's kernels (interpreted, float32): the greedy
    tokens and prompt logprobs of PEFT serving that adapter (`scored[name]`, default the same folder)
    within 1e-4. Short on purpose: the interpreter runs each kernel program in Python."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from loraserve import LLM
    from loraserve.lora.request import LoRARequest
    from support.parity import check_exact, greedy_params, hf_greedy, hf_logprobs

    calls = use_triton_lora(monkeypatch)
    llm = LLM(
        path,
        dtype="float32",
        enable_lora=True,
        max_loras=max(1, len(adapters) - 1),
        max_lora_rank=max(_adapter_rank(folder) for folder in adapters.values()),
        max_num_batched_tokens=64,
        **llm_kwargs,
    )
    names: list[str | None] = [None, *adapters]
    requests = {name: LoRARequest(name, i + 1, folder) for i, (name, folder) in enumerate(adapters.items())}
    outputs = llm.generate(
        [{"prompt_token_ids": prompt}] * len(names),
        greedy_params(num_new),
        lora_request=[requests[n] if n else None for n in names],
        use_tqdm=False,
    )
    assert calls, "no LoRA term ran through the Triton kernels"
    for out, name in zip(outputs, names):
        # One PeftModel per adapter: PEFT wants all adapters of a model with target_parameters alike.
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        if name is not None:
            model = PeftModel.from_pretrained(model, (scored or adapters)[name]).eval()
        check_exact(out, prompt, hf_greedy(model, prompt, num_new), hf_logprobs(model, prompt))


def _adapter_rank(folder: str) -> int:
    with open(os.path.join(folder, "adapter_config.json"), encoding="utf-8") as f:
        config = json.load(f)
    return max([int(config["r"]), *map(int, (config.get("rank_pattern") or {}).values())])
