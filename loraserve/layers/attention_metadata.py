"""The per-step attention metadata: where each new token's K/V goes and which blocks each sequence reads.

The model runner builds one `AttentionMetadata` per step and every layer reuses it. The batch is a
flat list of T new tokens from B sequences (prefill chunks and decodes mixed). What the kernels read is
small: one padded int32 block table, the context lengths and the query start offsets. The torch
path's gather indices ([B, max_ctx] slots, [B, max_q, max_ctx] masks) are built only when a layer
first takes that path in the step.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.layers.paged_attention_torch import GatherIndex, build_gather_index


@dataclass(slots=True)
class AttentionMetadata:
    """Per-step tensors shared by all layers (on the model's device).

    slot_mapping:   [T] int64 flat cache slot (block * block_size + offset) of each new token.
    block_tables:   [B, ceil(max_context_len / block_size)] int32 blocks of each sequence, in order
                    (zero-padded).
    context_lens:   [B] int32 tokens of each sequence in the cache once this step's are written.
    query_starts:   [B + 1] int32 offsets of each sequence's new tokens in the flat batch.
    sliding_window: the model's window (None without one); layers with a window pass it to attention
                    (Mistral: all layers, Qwen2: per `layer_types`).
    """

    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    context_lens: torch.Tensor
    query_starts: torch.Tensor
    query_lens_list: list[int]
    context_lens_list: list[int]
    block_size: int
    sliding_window: int | None
    num_seqs: int
    max_query_len: int
    max_context_len: int
    _gather: GatherIndex | None = None
    cpu_checked: object = None  # what the CPU kernel's checks of this step's tensors last passed for

    def gather_index(self) -> GatherIndex:
        """The torch path's gather indices for this step, built on first use."""
        if self._gather is None:
            self._gather = build_gather_index(
                self.query_lens_list, self.context_lens_list, self.block_tables, self.block_size,
                self.slot_mapping.device,
            )
        return self._gather


def build_attention_metadata(
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device | str,
    sliding_window: int | None = None,
) -> AttentionMetadata:
    """Metadata for one step.

    query_lens[i] new tokens of sequence i sit at positions context_lens[i] - query_lens[i] ..
    context_lens[i] - 1; block_tables[i] holds the sequence's physical blocks in order (at least
    ceil(context_lens[i] / block_size) of them)."""
    num_seqs = len(query_lens)
    max_q, max_ctx = max(query_lens), max(context_lens)
    num_blocks = (max_ctx + block_size - 1) // block_size
    rows = [blocks[:num_blocks] + [0] * (num_blocks - len(blocks[:num_blocks])) for blocks in block_tables]
    table = torch.tensor(rows, dtype=torch.int32).view(num_seqs, num_blocks)
    q_lens = torch.tensor(query_lens, dtype=torch.int32)
    query_starts = torch.zeros(num_seqs + 1, dtype=torch.int32)
    torch.cumsum(q_lens, 0, out=query_starts[1:])
    ctx_lens = torch.tensor(context_lens, dtype=torch.int32)

    # Slot of new token j of sequence i (position ctx - q + j).
    seq_of_token = torch.repeat_interleave(torch.arange(num_seqs), q_lens.long())
    positions = (ctx_lens - q_lens).long()[seq_of_token] + torch.arange(int(query_starts[-1])) - query_starts[
        seq_of_token
    ].long()
    slot_mapping = table[seq_of_token, positions // block_size].long() * block_size + positions % block_size
    return AttentionMetadata(
        slot_mapping=slot_mapping.to(device),
        block_tables=table.to(device),
        context_lens=ctx_lens.to(device),
        query_starts=query_starts.to(device),
        query_lens_list=list(query_lens),
        context_lens_list=list(context_lens),
        block_size=block_size,
        sliding_window=sliding_window,
        num_seqs=num_seqs,
        max_query_len=max_q,
        max_context_len=max_ctx,
    )
