"""Multi-LoRA shrink/expand as Triton kernels for CUDA, with the semantics of `lora_torch`.

Tokens are visited grouped by slot through the step's `LoRABatchMapping.segments` (token ids,
slot, start and length of each segment): the grid is (token blocks of the longest segment,
output blocks, active slots), each program loads one slot's weights once for a block of its tokens,
so no weight matrix is gathered per token and no two programs write the same output element.
Accumulation is fp32; fp32 inputs use IEEE products (no TF32) so results match the torch ops.
This module imports `triton`; `ops/__init__.py` only loads it when Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.batch.lora_mapping import LoRABatchMapping

_BLOCK_M = 16
_BLOCK_K = 64
_BLOCK_N = 64


@triton.jit
def _shrink_kernel(
    x_ptr, a_ptr, t_ptr, token_ids_ptr, seg_starts_ptr, seg_lens_ptr, slots_ptr, scales_ptr,
    in_features, rank, scale,
    stride_xm, stride_xk, stride_al, stride_ar, stride_ak, stride_tm, stride_tr,
    BLOCK_M: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, PRECISION: tl.constexpr,
    HAS_SCALES: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_r = tl.program_id(1)
    seg = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(slots_ptr + seg)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tokens = tl.load(token_ids_ptr + seg_start + offs_m, mask=mask_m, other=0)
    offs_r = pid_r * BLOCK_R + tl.arange(0, BLOCK_R)
    mask_r = offs_r < rank
    offs_k = tl.arange(0, BLOCK_K)
    acc = tl.zeros((BLOCK_M, BLOCK_R), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        kk = k0 + offs_k
        mask_k = kk < in_features
        x_tile = tl.load(
            x_ptr + tokens[:, None] * stride_xm + kk[None, :] * stride_xk,
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        a_tile = tl.load(
            a_ptr + slot * stride_al + offs_r[None, :] * stride_ar + kk[:, None] * stride_ak,
            mask=mask_r[None, :] & mask_k[:, None],
            other=0.0,
        )
        acc += tl.dot(x_tile, a_tile, input_precision=PRECISION)
    acc = acc * scale
    if HAS_SCALES:  # each token's own scale, in segment order (mapping.scales.by_segment)
        row_scales = tl.load(scales_ptr + seg_start + offs_m, mask=mask_m, other=1.0)
        acc = acc * row_scales[:, None]
    tl.store(
        t_ptr + tokens[:, None] * stride_tm + offs_r[None, :] * stride_tr,
        acc.to(t_ptr.dtype.element_ty),
        mask=mask_m[:, None] & mask_r[None, :],
    )


@triton.jit
def _expand_kernel(
    t_ptr, b_ptr, y_ptr, token_ids_ptr, seg_starts_ptr, seg_lens_ptr, slots_ptr,
    out_features, rank, offset,
    stride_tm, stride_tr, stride_bl, stride_bn, stride_br, stride_ym, stride_yn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    seg = tl.program_id(2)
    seg_len = tl.load(seg_lens_ptr + seg)
    if pid_m * BLOCK_M >= seg_len:
        return
    seg_start = tl.load(seg_starts_ptr + seg)
    slot = tl.load(slots_ptr + seg)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < seg_len
    tokens = tl.load(token_ids_ptr + seg_start + offs_m, mask=mask_m, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < out_features
    offs_r = tl.arange(0, BLOCK_R)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for r0 in range(0, rank, BLOCK_R):
        rr = r0 + offs_r
        mask_rr = rr < rank
        t_tile = tl.load(
            t_ptr + tokens[:, None] * stride_tm + rr[None, :] * stride_tr,
            mask=mask_m[:, None] & mask_rr[None, :],
            other=0.0,
        )
        b_tile = tl.load(
            b_ptr + slot * stride_bl + offs_n[None, :] * stride_bn + rr[:, None] * stride_br,
            mask=mask_n[None, :] & mask_rr[:, None],
            other=0.0,
        )
        acc += tl.dot(t_tile.to(b_tile.dtype), b_tile, input_precision=PRECISION)
    y_ptrs = y_ptr + tokens[:, None] * stride_ym + (offset + offs_n[None, :]) * stride_yn
    mask = mask_m[:, None] & mask_n[None, :]
    y_tile = tl.load(y_ptrs, mask=mask, other=0.0)
    tl.store(y_ptrs, (y_tile.to(tl.float32) + acc).to(y_ptr.dtype.element_ty), mask=mask)


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _block_r(rank: int) -> int:
    return min(max(16, triton.next_power_of_2(rank)), 128)


def lora_shrink(
    x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRABatchMapping, scale: float = 1.0
) -> torch.Tensor:
    """Triton `lora_torch.lora_shrink`: t[i] = scale * c_i * a_stacked[s_i] @ x[i] (c_i the token's
    scale, `mapping.scales`), 0 for slot -1."""
    return _shrink(x, a_stacked, mapping, scale, x.dtype)


def _shrink(
    x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRABatchMapping, scale: float, out_dtype: torch.dtype
) -> torch.Tensor:
    rank = a_stacked.shape[1]
    t = torch.zeros(x.shape[0], rank, dtype=out_dtype, device=x.device)
    if not mapping.has_lora:
        return t
    block_r = _block_r(rank)
    seg = mapping.segments
    grid = (triton.cdiv(seg.max_len, _BLOCK_M), triton.cdiv(rank, block_r), len(mapping.active_slots))
    scales = mapping.scales
    row_scales = seg.lens if scales is None else scales.by_segment  # any pointer when unread
    _shrink_kernel[grid](
        x, a_stacked, t, seg.token_ids, seg.starts, seg.lens, seg.slots, row_scales, x.shape[1], rank,
        float(scale), x.stride(0), x.stride(1), a_stacked.stride(0), a_stacked.stride(1), a_stacked.stride(2),
        t.stride(0), t.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_R=block_r, BLOCK_K=_BLOCK_K, PRECISION=_precision(x.dtype),
        HAS_SCALES=scales is not None,
    )  # fmt: skip
    return t


def lora_expand(
    y: torch.Tensor, t: torch.Tensor, b_stacked: torch.Tensor, mapping: LoRABatchMapping, offset: int = 0
) -> torch.Tensor:
    """Triton `lora_torch.lora_expand`: y[i, offset:offset+out] += b_stacked[s_i] @ t[i]."""
    num_segments = len(mapping.active_slots)
    if not mapping.has_lora:
        return y
    out_features, rank = b_stacked.shape[1], b_stacked.shape[2]
    seg = mapping.segments
    grid = (triton.cdiv(seg.max_len, _BLOCK_M), triton.cdiv(out_features, _BLOCK_N), num_segments)
    _expand_kernel[grid](
        t, b_stacked, y, seg.token_ids, seg.starts, seg.lens, seg.slots, out_features, rank, offset,
        t.stride(0), t.stride(1), b_stacked.stride(0), b_stacked.stride(1), b_stacked.stride(2),
        y.stride(0), y.stride(1),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_R=_block_r(rank), PRECISION=_precision(b_stacked.dtype),
    )  # fmt: skip
    return y


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    mapping: LoRABatchMapping,
    offset: int = 0,
) -> torch.Tensor:
    """Triton `lora_torch.add_lora`: shrink into an fp32 intermediate, then expand into y."""
    if not mapping.has_lora:
        return y
    # An fp32 intermediate keeps bf16/fp16 inputs at full precision between the two kernels.
    t = _shrink(x, a_stacked, mapping, 1.0, torch.float32)
    return lora_expand(y, t, b_stacked, mapping, offset)
