"""Paged attention test inputs (shuffled block tables, poisoned unused slots) and a float64 reference."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class AttentionCase:
    """A step: sequence i has query_lens[i] new tokens and context_lens[i] tokens in the cache."""

    query_lens: tuple[int, ...]
    context_lens: tuple[int, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype
    softcap: float | None = None
    window: int | None = None

    @property
    def scale(self) -> float:
        return self.head_dim**-0.5


@dataclass(frozen=True)
class AttentionInputs:
    q: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks * block_size, KVH, D]
    v_cache: torch.Tensor
    tables: list[list[int]]
    block_tables: torch.Tensor  # [B, max_blocks] int32
    context_lens: torch.Tensor  # [B] int32
    query_starts: torch.Tensor  # [B + 1] int32


def make_inputs(case: AttentionCase, seed: int) -> AttentionInputs:
    """Random q and caches; each sequence's blocks are a random, non-contiguous draw from a pool twice
    the size needed, and every cache slot no sequence owns (unused blocks, the tail of a last block)
    holds NaN, so reading one shows in the output. Block 0 is always in use (the torch path's padding
    reads slot 0)."""
    g = torch.Generator().manual_seed(seed)
    bs = case.block_size
    counts = [(ctx + bs - 1) // bs for ctx in case.context_lens]
    num_blocks = 2 * sum(counts) + 1
    pool = torch.randperm(num_blocks, generator=g).tolist()
    pool.remove(0)
    pool.insert(int(torch.randint(0, sum(counts), (1,), generator=g)), 0)
    tables, at = [], 0
    for n in counts:
        tables.append(pool[at : at + n])
        at += n
    shape = (num_blocks * bs, case.num_kv_heads, case.head_dim)
    k_cache = torch.full(shape, float("nan"))
    v_cache = torch.full(shape, float("nan"))
    for blocks, ctx in zip(tables, case.context_lens, strict=True):
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(ctx)], dtype=torch.long)
        k_cache[slots] = torch.randn(ctx, *shape[1:], generator=g)
        v_cache[slots] = torch.randn(ctx, *shape[1:], generator=g)
    q = torch.randn(sum(case.query_lens), case.num_heads, case.head_dim, generator=g)
    width = max(counts)
    block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    starts = [0]
    for n in case.query_lens:
        starts.append(starts[-1] + n)
    return AttentionInputs(
        q.to(case.dtype), k_cache.to(case.dtype), v_cache.to(case.dtype), tables, block_tables,
        torch.tensor(case.context_lens, dtype=torch.int32), torch.tensor(starts, dtype=torch.int32),
    )


def reference_attention(case: AttentionCase, inputs: AttentionInputs) -> torch.Tensor:
    """float64 attention straight from the definition, one sequence at a time: its query i at position
    p = ctx - q_len + i sees keys k <= p (and k > p - window), read through the block table; scores
    q.k * scale, softcapped, softmax over the visible keys. Returns [T, H, D] float64."""
    bs, group = case.block_size, case.num_heads // case.num_kv_heads
    outs = []
    for b, (blocks, q_len, ctx) in enumerate(zip(inputs.tables, case.query_lens, case.context_lens, strict=True)):
        start = int(inputs.query_starts[b])
        q = inputs.q[start : start + q_len].double()  # [q_len, H, D]
        slots = torch.tensor([blocks[k // bs] * bs + k % bs for k in range(ctx)], dtype=torch.long)
        k = inputs.k_cache[slots].double().repeat_interleave(group, dim=1)  # [ctx, H, D]
        v = inputs.v_cache[slots].double().repeat_interleave(group, dim=1)
        scores = torch.einsum("qhd,khd->qhk", q, k) * case.scale
        if case.softcap is not None:
            scores = case.softcap * torch.tanh(scores / case.softcap)
        pos = torch.arange(ctx - q_len, ctx).view(-1, 1, 1)
        key = torch.arange(ctx).view(1, 1, -1)
        visible = (key <= pos) & (key > pos - case.window if case.window is not None else True)
        probs = torch.softmax(scores.masked_fill(~visible, float("-inf")), dim=-1)
        outs.append(torch.einsum("qhk,khd->qhd", probs, v))
    return torch.cat(outs)


def tolerance(dtype: torch.dtype) -> dict[str, Any]:
    """Against the float64 reference: float32 sums in another order; bf16 also rounds the output (2^-8)."""
    if dtype == torch.float32:
        return {"atol": 2e-5, "rtol": 1e-4}
    return {"atol": 2e-2, "rtol": 2e-2}
