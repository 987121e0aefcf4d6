"""Counting the LoRA kernel's calls when some of them come from inside the C decoder stack.

The Gemma stack (models/gemma_stack.py) calls the C LoRA kernel through a function pointer, so a
monkeypatched `lora_cpu.run` does not see those steps; the stack's `run` is counted instead, for the
steps it served that had adapter rows.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loraserve.lora.ops import lora_cpu
from loraserve.models.gemma_stack import GemmaDecoderStack


def count_lora_kernel_steps(monkeypatch: pytest.MonkeyPatch) -> list[torch.dtype]:
    """The dtypes of every LoRA-kernel call, from Python (`lora_cpu.run`) or a Gemma stack step."""
    calls: list[torch.dtype] = []
    run, stack_run = lora_cpu.run, GemmaDecoderStack.run
    monkeypatch.setattr(lora_cpu, "run", lambda *args: calls.append(args[0].dtype) or run(*args))

    def counted_run(self: GemmaDecoderStack, residual: torch.Tensor, *args: Any) -> Any:
        result = stack_run(self, residual, *args)
        if result is not None and args[-1].lora is not None and args[-1].lora.has_lora:
            calls.append(residual.dtype)
        return result

    monkeypatch.setattr(GemmaDecoderStack, "run", counted_run)
    return calls
