"""LoRA shrink/expand ops: Triton kernels on CUDA when Triton is installed, torch everywhere else.

Both backends share the semantics documented in `torch_ops`:
    lora_shrink(x [T, in], a_stacked [L, R, in], mapping, scale) -> t [T, R]
    lora_expand(y [T, *], t [T, R], b_stacked [L, out, R], mapping, offset) adds into y[:, offset:offset+out]
    add_lora(y, x, a_stacked, b_stacked, mapping, offset) = lora_expand(y, lora_shrink(x, ...), ...)
where row i uses slot mapping.token_slots[i] and slot -1 contributes nothing (its rows of y are left
bit-for-bit alone). Row i reads only slot s_i's weights: a NaN or inf in one slot never reaches a
token of another slot, whatever the layout.
"""

from __future__ import annotations

import logging
from types import ModuleType

import torch

from loraserve.lora.mapping import LoRABatchMapping
from loraserve.lora.ops import torch_ops

logger = logging.getLogger(__name__)

_triton_ops: ModuleType | None = None
_triton_checked = False


def triton_available() -> bool:
    """True when the Triton kernels can be imported (CUDA tensors then use them)."""
    global _triton_ops, _triton_checked
    if not _triton_checked:
        _triton_checked = True
        try:
            from loraserve.lora.ops import triton_ops
        except Exception as e:  # not installed, or installed without a usable backend
            if not isinstance(e, ImportError):
                logger.warning("Triton LoRA kernels unavailable (%s); using the torch ops", e)
            triton_ops = None  # type: ignore[assignment]
        _triton_ops = triton_ops
    return _triton_ops is not None


def _backend(tensor: torch.Tensor) -> ModuleType:
    if tensor.is_cuda and triton_available():
        assert _triton_ops is not None
        return _triton_ops
    return torch_ops


def lora_shrink(
    x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRABatchMapping, scale: float = 1.0
) -> torch.Tensor:
    return _backend(x).lora_shrink(x, a_stacked, mapping, scale)


def lora_expand(
    y: torch.Tensor, t: torch.Tensor, b_stacked: torch.Tensor, mapping: LoRABatchMapping, offset: int = 0
) -> torch.Tensor:
    return _backend(y).lora_expand(y, t, b_stacked, mapping, offset)


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    mapping: LoRABatchMapping,
    offset: int = 0,
) -> torch.Tensor:
    return _backend(x).add_lora(y, x, a_stacked, b_stacked, mapping, offset)


__all__ = ["LoRABatchMapping", "add_lora", "lora_expand", "lora_shrink", "triton_available"]
