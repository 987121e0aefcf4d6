"""Paged attention in plain torch: gather each sequence's context out of the cache, then SDPA.

The twin of the C and Triton kernels and their test oracle, and the path for what they do not serve
(fp16, devices without a kernel, long prefill chunks on CPU where SDPA's matmuls win). It copies every
sequence's whole context into a padded [B, max_ctx] view and masks a [B, 1, max_q, max_ctx] score
matrix: causal, length-limited and, per window, sliding. Attention logit softcapping (Gemma-2) has no
SDPA kernel, so a call with a cap computes its scores explicitly.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


@dataclass(slots=True)
class GatherIndex:
    """One step's gather indices, built once and shared by every layer that takes this path.

    query_index:    [B * max_q] index into the T new tokens for each padded query row (pads point at
                    row T, a zero row appended at run time).
    output_index:   [T] index into the flattened padded [B * max_q] output for each new token.
    context_slots:  [B, max_ctx] flat cache slot of each context position (pads point at slot 0).
    query_pos:      [B, max_q, 1] absolute position of each padded query row.
    key_pos:        [1, 1, max_ctx] the context positions.
    base_mask:      [B, max_q, max_ctx] bool: causal and length-limited (pad rows see key 0 only, so
                    softmax never meets an all-masked row; their output is dropped).
    pad_rows:       [B, max_q, max_ctx] bool: key 0 of each pad row.
    masks:          the [B, 1, max_q, max_ctx] mask for each window asked for (None: no window).
    """

    query_index: torch.Tensor
    output_index: torch.Tensor
    context_slots: torch.Tensor
    query_pos: torch.Tensor
    key_pos: torch.Tensor
    base_mask: torch.Tensor
    pad_rows: torch.Tensor
    num_seqs: int
    max_query_len: int
    max_context_len: int
    masks: dict[int | None, torch.Tensor] = field(default_factory=dict)

    def mask(self, window: int | None) -> torch.Tensor:
        """The bool mask for keys k > p - window (all keys up to p when window is None)."""
        if window not in self.masks:
            mask = self.base_mask
            if window is not None:
                mask = (mask & (self.key_pos > self.query_pos - window)) | self.pad_rows
            self.masks[window] = mask.unsqueeze(1)
        return self.masks[window]


def build_gather_index(
    query_lens: list[int], context_lens: list[int], block_tables: torch.Tensor, block_size: int,
    device: torch.device,
) -> GatherIndex:
    """Gather indices for sequences with these query and context lengths; block_tables [B, >= blocks
    of the longest context] (any integer dtype, any device) holds each sequence's blocks in order."""
    num_seqs, max_q, max_ctx, total = len(query_lens), max(query_lens), max(context_lens), sum(query_lens)
    q_lens = torch.tensor(query_lens, dtype=torch.long, device=device)
    ctx_lens = torch.tensor(context_lens, dtype=torch.long, device=device)
    starts = torch.cumsum(q_lens, 0) - q_lens
    col = torch.arange(max_q, device=device).unsqueeze(0)
    valid_q = col < q_lens.unsqueeze(1)
    query_index = torch.where(valid_q, starts.unsqueeze(1) + col, torch.full_like(col, total))
    output_index = (torch.arange(num_seqs, device=device).unsqueeze(1) * max_q + col)[valid_q]

    # Position p of sequence i lives at slot block_tables[i][p // bs] * bs + p % bs.
    pos = torch.arange(max_ctx, device=device)
    table = block_tables.to(device=device, dtype=torch.long)
    context_slots = table[:, pos // block_size] * block_size + (pos % block_size)
    valid_k = pos.unsqueeze(0) < ctx_lens.unsqueeze(1)
    context_slots = torch.where(valid_k, context_slots, torch.zeros_like(context_slots))

    query_pos = ((ctx_lens - q_lens).unsqueeze(1) + col).unsqueeze(2)
    key_pos = pos.view(1, 1, -1)
    pad_rows = (~valid_q).unsqueeze(2) & (key_pos == 0)
    base_mask = ((key_pos <= query_pos) & valid_k.unsqueeze(1)) | pad_rows
    return GatherIndex(query_index.reshape(-1), output_index, context_slots, query_pos, key_pos, base_mask,
                       pad_rows, num_seqs, max_q, max_ctx)


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
    index: GatherIndex | None = None,
) -> torch.Tensor:
    """Attention of a flat batch of new tokens over their sequences' paged context.

    Semantics: sequence b owns tokens query_starts[b] .. query_starts[b+1]-1 and has context_lens[b]
    tokens in the cache (its new ones included, already written); its query i sits at position
    p = context_lens[b] - q_len + i and attends to keys 0..p (only k > p - window with a window), key k
    at slot block_tables[b][k // block_size] * block_size + k % block_size. Query head h uses KV head
    h // (H // KVH). Scores are q.k * scale, then softcap * tanh(s / softcap) with a cap (softmax in
    float32 then). `index`, when given, is this step's prebuilt `build_gather_index`.

    Shape: q [T, H, D] -> [T, H, D] in q's dtype; k_cache, v_cache [num_blocks * block_size, KVH, D];
    block_tables [B, max_blocks]; context_lens [B]; query_starts [B + 1]."""
    if index is None:
        starts = query_starts.tolist()
        query_lens = [end - start for start, end in zip(starts, starts[1:])]
        index = build_gather_index(query_lens, context_lens.tolist(), block_tables, block_size, q.device)
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[1]
    b, max_q, max_ctx = index.num_seqs, index.max_query_len, index.max_context_len
    is_decode = max_q == 1 and num_tokens == b  # one query per sequence: rows are already in padded order
    rows = q.reshape(num_tokens, num_heads * head_dim)
    if not is_decode:
        rows = torch.cat([rows, rows.new_zeros(1, rows.shape[1])]).index_select(0, index.query_index)
    q_pad = rows.view(b, max_q, num_heads, head_dim).transpose(1, 2)
    # index_select on the flat slot list is ~3.5x faster than advanced indexing on CPU.
    slots = index.context_slots.view(-1)
    k_ctx = k_cache.index_select(0, slots).view(b, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
    v_ctx = v_cache.index_select(0, slots).view(b, max_ctx, num_kv_heads, head_dim).transpose(1, 2)
    mask = index.mask(window)
    if softcap is not None:
        out = softcapped_attention(q_pad, k_ctx, v_ctx, mask, scale, softcap)
    else:
        out = F.scaled_dot_product_attention(
            q_pad, k_ctx, v_ctx, attn_mask=mask, scale=scale, enable_gqa=num_heads != num_kv_heads
        )
    out = out.transpose(1, 2).reshape(b * max_q, num_heads, head_dim)
    return out if is_decode else out.index_select(0, index.output_index)


def softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float, softcap: float
) -> torch.Tensor:
    """Attention with logit softcapping, as Gemma-2 defines it: scores = cap * tanh(q.k * scale / cap),
    then the mask, a float32 softmax and the values. q [B, H, Q, D], k/v [B, KVH, C, D] -> [B, H, Q, D]."""
    groups = q.shape[1] // k.shape[1]
    if groups > 1:
        k = k.repeat_interleave(groups, dim=1)
        v = v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)).float() * scale
    scores = torch.tanh(scores / softcap) * softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1).to(v.dtype)
    return torch.matmul(probs, v)
