"""Paged attention as a Triton kernel for CUDA, with the semantics of `paged_attention_torch`.

One program per (sequence, block of queries, KV head): its rows are the block's queries times the
group's query heads (GQA: each K/V tile is loaded once for all of them), and it walks the keys those
queries see in tiles of BLOCK_N, loading each key's row from the cache slot its block table names, with
an online softmax in float32. Decode, chunked prefill and mixed batches are the same kernel; a
sliding window narrows the keys walked. float32 inputs use IEEE products (no TF32) so results match
the twin. A quantized cache (`batch/kv_cache.py`) is read as bytes and decoded per tile: fp8 e5m2 as
the top byte of a float16, e4m3 rebuilt as float16 bits (its value / 2^8), int8 times its block's
scale; then times the tensor's scale, in q's dtype. This module imports `triton`; `attention.py` only
loads it when Triton is installed.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from loraserve.batch.kv_cache import KVScales
from loraserve.layers.kv_cache_formats import read_scales

_BLOCK_N = 32
# KV_FORMAT: how the kernel decodes the cache's elements.
_FORMATS = {torch.float8_e4m3fn: 1, torch.float8_e5m2: 2, torch.int8: 3}


@triton.jit
def _tanh(x):
    """tanh in float32 to ~1 ulp: an odd polynomial below |x| = 0.625 (Cephes), else through e^-2|x|."""
    z = x * x
    p = (((-5.70498872745e-3 * z + 2.06390887954e-2) * z - 5.37397155531e-2) * z + 1.33314422036e-1) * z
    small = x + x * (p - 3.33332819422e-1) * z
    a = tl.abs(x)
    e = tl.exp(-2.0 * a)
    large = (1.0 - e) / (1.0 + e)
    return tl.where(a < 0.625, small, tl.where(x < 0, -large, large))


@triton.jit
def _decode(raw, KV_FORMAT: tl.constexpr):
    """Stored elements as float32 before their scales: fp8 bytes (uint8) decoded through float16 bits, int8 widened."""
    if KV_FORMAT == 3:
        return raw.to(tl.float32)
    w = raw.to(tl.int16)
    if KV_FORMAT == 2:  # e5m2: the top byte of a float16
        return (w << 8).to(tl.int16).to(tl.float16, bitcast=True).to(tl.float32)
    mag = ((w << 7) & 0x3F80).to(tl.int16)  # e4m3: float16 bits of value / 2^8, sign from bit 7; 0x7f is NaN
    bits = (mag | ((w << 8) & -32768)).to(tl.int16)
    x = bits.to(tl.float16, bitcast=True).to(tl.float32) * 256.0
    return tl.where(mag == 0x3F80, float("nan"), x)


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, tables_ptr, context_lens_ptr, query_starts_ptr,
    k_scales_ptr, v_scales_ptr, k_scale, v_scale, num_kv_heads,
    scale, softcap, window, block_size, head_dim,
    stride_qt, stride_qh, stride_ks, stride_kh, stride_ot, stride_oh, stride_tb,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr, USE_SOFTCAP: tl.constexpr, USE_WINDOW: tl.constexpr, PRECISION: tl.constexpr,
    KV_FORMAT: tl.constexpr,
):  # fmt: skip
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    q_start = tl.load(query_starts_ptr + seq)
    q_len = tl.load(query_starts_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    query = q_block * BLOCK_Q + rows // GROUP_PAD
    head = kv_head * GROUP + rows % GROUP_PAD
    row_ok = (query < q_len) & (rows % GROUP_PAD < GROUP)
    pos = context_len - q_len + query
    offs_d = tl.arange(0, BLOCK_D)
    d_ok = offs_d < head_dim
    token = (q_start + query).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + offs_d[None, :],
        mask=row_ok[:, None] & d_ok[None, :], other=0.0,
    )
    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, BLOCK_D], tl.float32)
    first_pos = context_len - q_len + q_block * BLOCK_Q
    key_end = context_len - q_len + tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
    key_begin = 0
    if USE_WINDOW:
        key_begin = tl.maximum(first_pos - window + 1, 0)
    for start in range(key_begin, key_end, BLOCK_N):
        kpos = start + tl.arange(0, BLOCK_N)
        k_ok = kpos < key_end
        block = tl.load(tables_ptr + seq * stride_tb + kpos // block_size, mask=k_ok, other=0)
        slot = block.to(tl.int64) * block_size + kpos % block_size
        kv_offsets = slot[:, None] * stride_ks + kv_head * stride_kh + offs_d[None, :]
        kv_mask = k_ok[:, None] & d_ok[None, :]
        if KV_FORMAT == 0:  # a float cache, in q's dtype or converted to it (bf16 under float32)
            k = tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
            v = tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0.0).to(q.dtype)
        else:
            k = _decode(tl.load(k_ptr + kv_offsets, mask=kv_mask, other=0), KV_FORMAT)
            v = _decode(tl.load(v_ptr + kv_offsets, mask=kv_mask, other=0), KV_FORMAT)
            if KV_FORMAT == 3:  # int8: each key's block scale for this KV head
                at = block.to(tl.int64) * num_kv_heads + kv_head
                k = k * tl.load(k_scales_ptr + at, mask=k_ok, other=0.0)[:, None]
                v = v * tl.load(v_scales_ptr + at, mask=k_ok, other=0.0)[:, None]
            else:
                k = k * k_scale
                v = v * v_scale
            k = k.to(q.dtype)
            v = v.to(q.dtype)
        s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale
        if USE_SOFTCAP:
            s = softcap * _tanh(s / softcap)
        visible = (kpos[None, :] <= pos[:, None]) & k_ok[None, :] & row_ok[:, None]
        if USE_WINDOW:
            visible = visible & (kpos[None, :] > pos[:, None] - window)
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row with no key yet: keep zeros
        alpha = tl.exp(m_i - m_safe)
        p = tl.exp(s - m_safe[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
        m_i = m_new
    out = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :],
    )


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_starts: torch.Tensor,
    block_size: int,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    max_query_len: int | None = None,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Attention of a flat batch of new tokens over their sequences' paged context, K/V read in place.

    Semantics: those of `paged_attention_torch.paged_attention` (causal per sequence, keys k > p - window
    with a window, GQA, optional softcap), accumulated in float32 with an online softmax.
    `max_query_len` (the longest query_starts step) sizes the grid; None reads it from query_starts.

    Shape: q [T, H, D] (unit stride along D) -> [T, H, D] contiguous, q's dtype; k_cache, v_cache
    [num_blocks * block_size, KVH, D] with unit stride along D and equal strides, in q's dtype or a
    format of `batch/kv_cache.py` read through `scales`; block_tables [B, max_blocks], context_lens [B],
    query_starts [B + 1] (int32)."""
    scales = read_scales(k_cache.dtype, scales)
    kv_format = _FORMATS.get(k_cache.dtype, 0)
    k_blocks = scales.k_blocks if scales.k_blocks is not None else q  # (a pointer the kernel never reads)
    v_blocks = scales.v_blocks if scales.v_blocks is not None else q
    if kv_format in (1, 2):  # fp8 as its bytes: decoded in the kernel
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    if num_heads % num_kv_heads or k_cache.stride() != v_cache.stride() or k_cache.stride(2) != 1 or q.stride(2) != 1:
        raise ValueError(f"q {tuple(q.shape)} and caches {tuple(k_cache.shape)} do not fit the kernel's layout")
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype, device=q.device)
    num_seqs = context_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    if max_query_len is None:
        max_query_len = int((query_starts[1:] - query_starts[:-1]).max())
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    rows = 16 if max_query_len == 1 else 64  # decode: one query per program; prefill: a block of them
    block_q = max(1, rows // group_pad)
    grid = (num_seqs, triton.cdiv(max_query_len, block_q), num_kv_heads)
    _paged_attention_kernel[grid](
        q, k_cache, v_cache, out, block_tables, context_lens, query_starts,
        k_blocks, v_blocks, float(scales.k), float(scales.v), num_kv_heads,
        float(scale), float(softcap or 1.0), int(window or 0), block_size, head_dim,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), out.stride(0), out.stride(1),
        block_tables.stride(0),
        GROUP=group, GROUP_PAD=group_pad, BLOCK_Q=block_q, BLOCK_N=_BLOCK_N,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)), USE_SOFTCAP=softcap is not None,
        USE_WINDOW=window is not None, PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        KV_FORMAT=kv_format,
    )  # fmt: skip
    return out
