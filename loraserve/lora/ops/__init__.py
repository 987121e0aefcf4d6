"""The LoRA ops, and the one place that picks their backend: the fused C kernel where `lora_cpu.serves`
(float32 or bfloat16 CPU, short segments; the decoder stack asks the same predicate), Triton kernels
(CUDA with Triton installed) or torch (everywhere else).

`add_lora(y, x, buffers, mapping)` is what a LoRA layer runs. The tensor-level ops share the
semantics documented in `lora_torch`:
    lora_shrink(x [T, in], a_stacked [L, R, in], mapping, scale) -> t [T, R]
    lora_expand(y [T, *], t [T, R], b_stacked [L, out, R], mapping, offset) adds into y[:, offset:offset+out]
where row i uses slot mapping.token_slots[i] and slot -1 contributes nothing (its rows of y are left
bit-for-bit alone). Row i reads only slot s_i's weights: a NaN or inf in one slot never reaches a
token of another slot, whatever the layout and backend.
"""

from __future__ import annotations

from types import ModuleType

import torch
import torch.nn.functional as F

from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.lora.ops import lora_cpu, lora_torch
from loraserve.lora.ops.buffers import LoRABuffers
from loraserve.native.optional import triton_module

_TRITON_MODULE = "loraserve.lora.ops.lora_triton"


def _backend(tensor: torch.Tensor) -> ModuleType:
    if tensor.is_cuda and (triton := triton_module(_TRITON_MODULE)) is not None:
        return triton
    return lora_torch


def add_lora(y: torch.Tensor, x: torch.Tensor, buffers: LoRABuffers, mapping: LoRABatchMapping) -> None:
    """y[i] += c_i (B[s_i] A[s_i] x[i] (+ bias[s_i])) for every token i whose slot s_i >= 0, in place
    (c_i the token's scale, `mapping.scales`, 1 without).

    x [..., in]; y [..., out] contiguous (a layer's output). Computed in the buffers' dtype; a layer
    none of whose slots the step uses costs two integer tests."""
    use_ab = buffers.active_mask & mapping.active_mask
    use_bias = buffers.bias_mask & mapping.active_mask
    if not (use_ab or use_bias):
        return
    x2, y2 = x.reshape(-1, x.shape[-1]), y.view(-1, y.shape[-1])
    lora_dtype = buffers.lora_a.dtype
    same_dtype = lora_dtype == y.dtype
    delta = y2 if same_dtype else torch.zeros(y2.shape, dtype=lora_dtype, device=y2.device)
    if use_ab:
        x2 = x2.to(lora_dtype)
        args = buffers.cpu_kernel_args
        if args is not None and lora_cpu.serves(args, mapping, lora_dtype):
            lora_cpu.run(x2, delta, args, mapping)
        else:
            _backend(x2).add_lora(delta, x2, buffers.lora_a, buffers.lora_b, mapping)
    if use_bias:
        assert buffers.bias is not None
        # Row max_loras of the padded table is zero: tokens without an adapter add nothing.
        table = F.pad(buffers.bias, (0, 0, 0, 1))
        rows = torch.where(mapping.token_slots < 0, buffers.max_loras, mapping.token_slots)
        bias_rows = table.index_select(0, rows)
        if mapping.scales is not None:  # a request's scale multiplies its adapter's whole term, as PEFT's
            bias_rows.mul_(mapping.scales.by_token)
        delta.add_(bias_rows)
    if not same_dtype:
        y2.add_(delta.to(y2.dtype))


def apply_dora(
    y: torch.Tensor, base_bias: torch.Tensor | None, buffers: LoRABuffers, mapping: LoRABatchMapping
) -> None:
    """y[i] = g[s_i] * (y[i] - b) + b for the tokens whose slot holds a DoRA adapter here, in place:
    PEFT's unmerged DoRA, y = g * (x W^T + s B A x) + b, once the LoRA term is in y. Rows of other
    slots are left bit-for-bit alone (their g is exactly 1, as is row max_loras for slot -1)."""
    if not buffers.dora_mask & mapping.active_mask:
        return
    assert buffers.dora is not None
    y2 = y.view(-1, y.shape[-1])
    rows = torch.where(mapping.token_slots < 0, buffers.max_loras, mapping.token_slots)
    dora_rows = buffers.dora[rows]
    uses = (dora_rows != 1.0).any(dim=1)
    scaled = y2.float() if base_bias is None else y2.float() - base_bias.float()
    scaled = scaled * dora_rows
    if base_bias is not None:
        scaled = scaled + base_bias.float()
    y2.copy_(torch.where(uses[:, None], scaled.to(y2.dtype), y2))


def lora_shrink(
    x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRABatchMapping, scale: float = 1.0
) -> torch.Tensor:
    return _backend(x).lora_shrink(x, a_stacked, mapping, scale)


def lora_expand(
    y: torch.Tensor, t: torch.Tensor, b_stacked: torch.Tensor, mapping: LoRABatchMapping, offset: int = 0
) -> torch.Tensor:
    return _backend(y).lora_expand(y, t, b_stacked, mapping, offset)


__all__ = ["LoRABuffers", "add_lora", "apply_dora", "lora_expand", "lora_shrink"]
