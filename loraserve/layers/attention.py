"""Paged attention over a flat token batch: KV write by slot mapping, per-sequence gather, SDPA.

The model runner builds one `AttentionMetadata` per step; every layer reuses it. The batch is a flat
list of T new tokens from B sequences (prefill chunks and decodes mixed). Each layer writes its new K/V
into the paged cache at `slot_mapping`, gathers each sequence's whole context into a padded
[B, max_ctx] view and runs scaled-dot-product attention with a mask that is causal, length-limited and
(optionally) sliding-window. Attention logit softcapping (Gemma-2: `cap * tanh(scores / cap)` before
the mask) has no SDPA kernel, so a layer with a cap computes its scores explicitly. The same torch code
runs on CPU and CUDA.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step index tensors shared by all layers.

    slot_mapping:       [T] flat cache slot (block * block_size + offset) for each new token.
    query_index:        [B * max_q] index into the T new tokens for each padded query row (pads point
                        at row T, a zero row appended at run time).
    output_index:       [T] index into the flattened padded [B * max_q] output for each new token.
    context_slots:      [B, max_ctx] flat cache slot of each context position (pads point at slot 0).
    mask:               [B, 1, max_q, max_ctx] bool, True where the query may attend.
    sliding_mask:       the same, further limited to the model's sliding window (None without one);
                        layers with a window use it (Mistral: all layers, Qwen2: per `layer_types`).
    """

    slot_mapping: torch.Tensor
    query_index: torch.Tensor
    output_index: torch.Tensor
    context_slots: torch.Tensor
    mask: torch.Tensor
    sliding_mask: torch.Tensor | None
    num_seqs: int
    max_query_len: int
    max_context_len: int


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Index tensors for one step.

    query_lens[i] new tokens of sequence i sit at positions context_lens[i] - query_lens[i] ..
    context_lens[i] - 1; block_tables[i] holds the sequence's physical blocks in order.
    """
    num_seqs = len(query_lens)
    max_q = max(query_lens)
    max_ctx = max(context_lens)
    total = sum(query_lens)
    q_lens = torch.tensor(query_lens, dtype=torch.long)
    ctx_lens = torch.tensor(context_lens, dtype=torch.long)

    # Query rows: padded [B, max_q] -> flat token index, pads -> total (the zero row).
    starts = torch.cumsum(q_lens, 0) - q_lens
    col = torch.arange(max_q).unsqueeze(0)
    valid_q = col < q_lens.unsqueeze(1)
    query_index = torch.where(valid_q, starts.unsqueeze(1) + col, torch.full_like(col, total))
    output_index = (torch.arange(num_seqs).unsqueeze(1) * max_q + col)[valid_q]

    # Context slots: position p of sequence i lives at block_tables[i][p // bs] * bs + p % bs.
    num_ctx_blocks = (max_ctx + block_size - 1) // block_size
    table = torch.zeros(num_seqs, num_ctx_blocks, dtype=torch.long)
    for i, blocks in enumerate(block_tables):
        n = min(len(blocks), num_ctx_blocks)
        table[i, :n] = torch.tensor(blocks[:n], dtype=torch.long)
    pos = torch.arange(max_ctx)
    context_slots = table[:, pos // block_size] * block_size + (pos % block_size)
    valid_k = pos.unsqueeze(0) < ctx_lens.unsqueeze(1)
    context_slots = torch.where(valid_k, context_slots, torch.zeros_like(context_slots))

    q_pos = (ctx_lens - q_lens).unsqueeze(1) + col  # [B, max_q] absolute positions
    k_pos = pos.view(1, 1, -1)
    # Pad query rows attend to key 0 so softmax never sees an all-masked row (their output is dropped).
    pad_rows = (~valid_q).unsqueeze(2) & (k_pos == 0)
    mask = ((k_pos <= q_pos.unsqueeze(2)) & valid_k.unsqueeze(1)) | pad_rows
    sliding_mask = None
    if sliding_window is not None:
        sliding_mask = (mask & (k_pos > (q_pos.unsqueeze(2) - sliding_window))) | pad_rows

    slot_mapping = torch.cat(
        [context_slots[i, ctx - q : ctx] for i, (q, ctx) in enumerate(zip(query_lens, context_lens))]
    )
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        query_index=query_index.reshape(-1).to(device),
        output_index=output_index.to(device),
        context_slots=context_slots.to(device),
        mask=mask.unsqueeze(1).to(device),
        sliding_mask=None if sliding_mask is None else sliding_mask.unsqueeze(1).to(device),
        num_seqs=num_seqs,
        max_query_len=max_q,
        max_context_len=max_ctx,
    )


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
        kv_cache: tuple[torch.Tensor, torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, KVH*D] -> [T, H*D]."""
        num_tokens = q.shape[0]
        k_cache, v_cache = kv_cache
        k_cache.index_copy_(0, meta.slot_mapping, k.view(num_tokens, self.num_kv_heads, self.head_dim))
        v_cache.index_copy_(0, meta.slot_mapping, v.view(num_tokens, self.num_kv_heads, self.head_dim))

        b, max_q, max_ctx = meta.num_seqs, meta.max_query_len, meta.max_context_len
        is_decode = max_q == 1  # one query per sequence: rows are already in padded order
        q_rows = q if is_decode else torch.cat([q, q.new_zeros(1, q.shape[1])]).index_select(0, meta.query_index)
        q_pad = q_rows.view(b, max_q, self.num_heads, self.head_dim).transpose(1, 2)
        # index_select on the flat slot list is ~3.5x faster than advanced indexing on CPU.
        slots = meta.context_slots.view(-1)
        k_ctx = k_cache.index_select(0, slots).view(b, max_ctx, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v_ctx = v_cache.index_select(0, slots).view(b, max_ctx, self.num_kv_heads, self.head_dim).transpose(1, 2)
        mask = meta.sliding_mask if self.use_sliding_window and meta.sliding_mask is not None else meta.mask
        if self.softcap is not None:
            out = softcapped_attention(q_pad, k_ctx, v_ctx, mask, self.scale, self.softcap)
        else:
            out = F.scaled_dot_product_attention(
                q_pad, k_ctx, v_ctx, attn_mask=mask, scale=self.scale, enable_gqa=self.num_heads != self.num_kv_heads
            )
        out = out.transpose(1, 2).reshape(b * max_q, self.num_heads * self.head_dim)
        return out if is_decode else out.index_select(0, meta.output_index)


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
