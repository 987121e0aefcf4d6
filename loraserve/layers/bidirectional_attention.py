"""Image tokens that see each other both ways: the rows of a step's attention output that belong to a
`BidirectionalSpan` (Gemma-3's image tokens, whose mask is causal OR same-image) computed again over
their sequence's cached keys with that mask.

The span's keys are all in the cache once the step's K/V are written (the scheduler never ends a chunk
inside such a span, and a cached prefix holds the rest), so the causal pass first computes every row
and this pass replaces the few image rows: a prefill step with images pays one small masked attention
per image, every other step nothing. Semantics, as transformers' blockwise overlay: query at position p
of a span over [key_start, key_end) attends to key k when k <= p or key_start <= k < key_end, and,
with a window, only to k > p - window. Plain torch (gather + SDPA): it is the oracle's math, on a
handful of rows; the keys and values are read in the cache's format (`kv_cache_formats.read_rows`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraserve.batch.attention_metadata import AttentionMetadata, BidirectionalSpan
from loraserve.batch.kv_cache import KVCache
from loraserve.layers.kv_cache_formats import read_rows
from loraserve.layers.paged_attention_torch import softcapped_attention


def attend_spans(
    out: torch.Tensor,
    q: torch.Tensor,
    kv: KVCache,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
) -> None:
    """Recompute `out`'s rows of every span in `meta.bidirectional`, in place. out, q [T, H, D];
    the cache's rows [num_blocks * block_size, KVH, D] in any of its formats."""
    for span in meta.bidirectional:
        out[span.row_start : span.row_end] = _span_attention(
            q[span.row_start : span.row_end], kv, meta, span, scale, softcap, window
        )


def _span_attention(
    q: torch.Tensor,
    kv: KVCache,
    meta: AttentionMetadata,
    span: BidirectionalSpan,
    scale: float,
    softcap: float | None,
    window: int | None,
) -> torch.Tensor:
    num_rows, num_heads, head_dim = q.shape
    num_kv_heads = kv.k.shape[1]
    positions = torch.arange(span.first_pos, span.first_pos + num_rows, device=q.device)
    keys = torch.arange(max(span.first_pos + num_rows, span.key_end), device=q.device)
    table = meta.block_tables[span.seq].to(torch.long)
    slots = table[keys // meta.block_size] * meta.block_size + keys % meta.block_size
    size, scales = meta.block_size, kv.scales
    # [1, KVH, L, D] each, as values of q's dtype
    k = read_rows(kv.k, slots, size, scales.k_blocks, scales.k, q.dtype).transpose(0, 1)[None]
    v = read_rows(kv.v, slots, size, scales.v_blocks, scales.v, q.dtype).transpose(0, 1)[None]
    allowed = (keys[None] <= positions[:, None]) | (
        (keys[None] >= span.key_start) & (keys[None] < span.key_end)
    )
    if window is not None:
        allowed &= keys[None] > positions[:, None] - window
    query = q.transpose(0, 1)[None]  # [1, H, n, D]
    mask = allowed[None, None]
    if softcap is not None:
        out = softcapped_attention(query, k, v, mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(
            query, k, v, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    return out[0].transpose(0, 1).reshape(num_rows, num_heads, head_dim)
