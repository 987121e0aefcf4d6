"""Paged attention for one layer: write the new K/V into the paged cache, then attend, on the fastest
backend that serves the step.

Backends, all with the semantics of `paged_attention_torch.paged_attention`: the C kernel on CPU
(`paged_attention_cpu`, K/V read in place through the block tables; float32 and bf16 activations, a
cache in any format of `batch/kv_cache.py`), the Triton kernel on CUDA when Triton is installed
(`paged_attention_triton`), and the torch gather + SDPA twin for everything else (fp16 on CPU, other
devices, LORASERVE_CPU_ATTENTION_KERNEL=0). Off the C kernel the new rows are written by
`kv_cache_formats.write_kv`, in the cache's format. The CPU kernel
takes every step, long prefill chunks included: it beat SDPA at every chunk length measured
(benchmarks/README.md), and a mixed step on the torch path pads every decode to the longest chunk.
"""

from __future__ import annotations

import torch
from torch import nn

from loraserve.batch.attention_metadata import AttentionMetadata
from loraserve.batch.kv_cache import KVCache, KVScales
from loraserve.layers import paged_attention_cpu, paged_attention_torch
from loraserve.layers.bidirectional_attention import attend_spans
from loraserve.layers.kv_cache_formats import write_kv
from loraserve.native.optional import triton_module

_TRITON_MODULE = "loraserve.layers.paged_attention_triton"


def attend(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Attention of the step's new tokens over the cache (their K/V already written), on the backend
    that serves it. q [T, H, D] -> [T, H, D]; caches [num_blocks * block_size, KVH, D], read through
    `scales` where quantized."""
    args = (meta.block_tables, meta.context_lens, meta.query_starts, meta.block_size, scale, softcap, window)
    if q.is_cpu:
        if paged_attention_cpu.serves(q, k_cache, v_cache, scales=scales):
            return paged_attention_cpu.paged_attention(q, k_cache, v_cache, *args, scales=scales)
    elif q.is_cuda and (triton := triton_module(_TRITON_MODULE)) is not None:
        return triton.paged_attention(q, k_cache, v_cache, *args, max_query_len=meta.max_query_len, scales=scales)
    return paged_attention_torch.paged_attention(q, k_cache, v_cache, *args, index=meta.gather_index(), scales=scales)


class PagedAttention(nn.Module):
    """Attention for one layer over its paged KV cache ([num_blocks * block_size, kv_heads, head_dim])."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        scale: float,
        use_sliding_window: bool = False,
        softcap: float | None = None,
    ) -> None:
        super().__init__()
        self.use_sliding_window = use_sliding_window
        self.softcap = softcap
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KVH*D] -> [T, H*D]."""
        num_tokens = q.shape[0]
        k_cache, v_cache, scales = kv_cache.k, kv_cache.v, kv_cache.scales
        window = meta.sliding_window if self.use_sliding_window else None
        q_heads = q.view(num_tokens, self.num_heads, self.head_dim)
        if q.is_cpu:  # the C kernel writes the new rows itself: one call per layer
            out = paged_attention_cpu.write_and_attend(q_heads, k, v, k_cache, v_cache, meta, self.scale,
                                                       self.softcap, window, scales)
            if out is not None:
                if meta.bidirectional:
                    attend_spans(out, q_heads, kv_cache, meta, self.scale, self.softcap, window)
                return out.view(num_tokens, self.num_heads * self.head_dim)
        write_kv(kv_cache, k.view(num_tokens, self.num_kv_heads, self.head_dim),
                 v.view(num_tokens, self.num_kv_heads, self.head_dim), meta.slot_mapping, meta.block_size)
        out = attend(q_heads, k_cache, v_cache, meta, self.scale, self.softcap, window, scales)
        if meta.bidirectional:
            attend_spans(out, q_heads, kv_cache, meta, self.scale, self.softcap, window)
        return out.reshape(num_tokens, self.num_heads * self.head_dim)
