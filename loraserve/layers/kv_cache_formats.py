"""The KV cache's formats in torch: writing a step's new rows into their slots and reading stored rows
back as values, as `batch/kv_cache.py` defines each format.

The twin of the C kernel's write (`paged_attention_write.h`): the same bytes for every format (fp8
through torch's own rounding on values clamped to the format's range; int8 with the same runs, scales
and float32 operations), so either path can write a cache the other reads. It serves every step the C
kernel does not (CUDA, fp16, LORASERVE_CPU_ATTENTION_KERNEL=0) and is the tests' oracle of the write.
"""

from __future__ import annotations

import torch

from loraserve.batch.kv_cache import FP8_DTYPES, INT8_LEVELS, KVCache, KVScales, check_scales, fp8_max


def write_kv(
    kv: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, block_size: int
) -> None:
    """Rows k[t], v[t] ([T, KVH * D] or [T, KVH, D], any float dtype) into cache slot slot_mapping[t], in
    the cache's format (`index_copy_` for a cache of the rows' dtype). The slots of one block follow
    one another within a step (a sequence's new tokens), as the scheduler writes them."""
    _write(kv.k, kv.scales.k_blocks, kv.scales.k, k, slot_mapping, block_size)
    _write(kv.v, kv.scales.v_blocks, kv.scales.v, v, slot_mapping, block_size)


def read_rows(
    cache: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
    blocks: torch.Tensor | None,
    scale: float,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Cache rows `slots` ([N] -> [N, KVH, D]) as values in `dtype`: fp8 times the tensor's scale, int8
    times its block's scale (per KV head), dequantized in float32."""
    if cache.dtype in FP8_DTYPES:  # (torch's CPU index ops take fp8 as bytes only)
        rows = cache.view(torch.uint8).index_select(0, slots).view(cache.dtype)
        return (rows.float() * scale).to(dtype)
    rows = cache.index_select(0, slots)
    if cache.dtype == torch.int8:
        assert blocks is not None
        return (rows.float() * blocks.index_select(0, slots // block_size).unsqueeze(-1)).to(dtype)
    return rows.to(dtype)


def read_scales(kv_dtype: torch.dtype, scales: KVScales | None) -> KVScales:
    """The scales a cache of `kv_dtype` is read with (none given: fp8's 1.0; int8 must bring its own)."""
    check_scales(kv_dtype, scales)
    return scales if scales is not None else KVScales()


def _write(
    cache: torch.Tensor,
    blocks: torch.Tensor | None,
    scale: float,
    rows: torch.Tensor,
    slots: torch.Tensor,
    block_size: int,
) -> None:
    rows = rows.reshape(slots.shape[0], *cache.shape[1:])
    if cache.dtype in FP8_DTYPES:
        limit = fp8_max(cache.dtype)  # saturate, as vLLM's writer does (torch's cast would give NaN/inf)
        stored = (rows.float() / scale).clamp(-limit, limit).to(cache.dtype)
        cache.view(torch.uint8).index_copy_(0, slots, stored.view(torch.uint8))
    elif cache.dtype == torch.int8:
        assert blocks is not None
        _write_int8(cache, blocks, rows.float(), slots, block_size)
    else:
        cache.index_copy_(0, slots, rows.to(cache.dtype))


def _levels(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """round(x / scale) as int8: nearest even, clamped to +-127, 0 where NaN (the C kernel's int8_level)."""
    return torch.round(x / scale).clamp(-INT8_LEVELS, INT8_LEVELS).nan_to_num(0.0).to(torch.int8)


def _write_int8(
    cache: torch.Tensor, blocks: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor, bs: int
) -> None:
    """Rows [T, KVH, D] float32 into an int8 cache by runs (slots that follow one another in a block):
    per run and head, a run at the block's slot 0 sets the scale to amax / 127; a later one whose amax
    exceeds scale * 127 (or is NaN) requantizes the block's earlier rows to amax / 127 first."""
    num_tokens, num_kv_heads = rows.shape[0], rows.shape[1]
    if num_tokens == 0:
        return
    offsets = slots % bs
    starts = torch.ones(num_tokens, dtype=torch.bool, device=rows.device)
    starts[1:] = (slots[1:] != slots[:-1] + 1) | (offsets[1:] == 0)
    run = torch.cumsum(starts, 0) - 1
    firsts = starts.nonzero().squeeze(1)
    num_runs = firsts.shape[0]
    run_block, run_offset = slots[firsts] // bs, offsets[firsts]
    head_amax = rows.abs().amax(-1)  # [T, KVH]; NaN where a row's head holds one
    index = run.unsqueeze(1).expand(num_tokens, num_kv_heads)
    amax = rows.new_zeros(num_runs, num_kv_heads).scatter_reduce_(0, index, head_amax.nan_to_num(0.0), "amax")
    has_nan = rows.new_zeros(num_runs, num_kv_heads).scatter_reduce_(
        0, index, head_amax.isnan().float(), "amax"
    )
    amax = torch.where(has_nan > 0, torch.full_like(amax, float("nan")), amax)
    old = blocks.index_select(0, run_block)
    fresh = (run_offset == 0).unsqueeze(1)
    grow = fresh | ~(amax <= old * INT8_LEVELS)
    new = torch.where(grow, amax / INT8_LEVELS, old)
    requant = grow & ~fresh  # [R, KVH]: earlier rows of the block to bring to the new scale
    if bool(requant.any()):
        block_slots = (run_block.unsqueeze(1) * bs + torch.arange(bs, device=rows.device)).reshape(-1)
        stored = cache.index_select(0, block_slots).view(num_runs, bs, num_kv_heads, -1)
        earlier = torch.arange(bs, device=rows.device).unsqueeze(0) < run_offset.unsqueeze(1)  # [R, bs]
        change = earlier.unsqueeze(2) & requant.unsqueeze(1)  # [R, bs, KVH]
        again = _levels(stored.float() * old[:, None, :, None], new[:, None, :, None])
        stored = torch.where(change.unsqueeze(3), again, stored)
        cache.index_copy_(0, block_slots, stored.reshape(num_runs * bs, num_kv_heads, -1))
    blocks.index_copy_(0, run_block, new)
    cache.index_copy_(0, slots, _levels(rows, new.index_select(0, run).unsqueeze(2)))
