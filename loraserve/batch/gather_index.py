"""The torch attention path's per-step gather indices: which cache slots each sequence's context
reads, where each new token's query row sits in the padded batch, and the causal / sliding masks.

Built once per step, on the first layer that takes the torch path (`AttentionMetadata.gather_index`),
and shared by every layer after it; the kernels never build it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


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
