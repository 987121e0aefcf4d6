"""The per-step attention metadata: where each new token's K/V goes and which blocks each sequence reads.

The model runner builds one `AttentionMetadata` per step and every layer reuses it. The batch is a
flat list of T new tokens from B sequences (prefill chunks and decodes mixed). What the kernels read is
small: one padded int32 block table, the context lengths and the query start offsets. The torch
path's gather indices ([B, max_ctx] slots, [B, max_q, max_ctx] masks) are built only when a layer
first takes that path in the step.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from loraserve.batch.gather_index import GatherIndex, build_gather_index


@dataclass(frozen=True, slots=True)
class BidirectionalSpan:
    """Query rows [row_start, row_end) of the flat batch, tokens of batch sequence `seq` at positions
    first_pos, first_pos + 1, ..., that attend to every key position in [key_start, key_end) besides
    their causal context: the tokens of one image, which see each other both ways (Gemma-3). Every
    key of the span is in the cache once the step's rows are written."""

    seq: int
    row_start: int
    row_end: int
    first_pos: int
    key_start: int
    key_end: int


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
    bidirectional:  spans of image tokens that attend to each other both ways (`BidirectionalSpan`);
                    empty for causal attention everywhere.
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
    bidirectional: tuple[BidirectionalSpan, ...] = ()

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
    ceil(context_lens[i] / block_size) of them). Built from Python lists with two tensor copies: a
    decode step runs this once, where a dozen small tensor ops cost more than the lists."""
    num_seqs = len(query_lens)
    max_q, max_ctx = max(query_lens), max(context_lens)
    num_blocks = (max_ctx + block_size - 1) // block_size
    ints: list[int] = []  # the block table's rows, then query_starts, then context_lens (all int32)
    for blocks in block_tables:
        row = blocks[:num_blocks]
        ints += row
        if len(row) < num_blocks:
            ints += [0] * (num_blocks - len(row))
    ints += itertools.accumulate(query_lens, initial=0)
    ints += context_lens
    slots: list[int] = []  # each new token's cache slot, a range per block it touches
    for blocks, q_len, ctx in zip(block_tables, query_lens, context_lens, strict=True):
        pos = ctx - q_len
        while pos < ctx:
            block, offset = divmod(pos, block_size)
            end = min(ctx, pos - offset + block_size)
            first = blocks[block] * block_size + offset
            slots += range(first, first + end - pos)
            pos = end
    flat = torch.tensor(ints, dtype=torch.int32).to(device)
    table, query_starts, ctx_lens = flat.split([num_seqs * num_blocks, num_seqs + 1, num_seqs])
    slot_mapping = torch.tensor(slots, dtype=torch.long).to(device)
    return AttentionMetadata(
        slot_mapping=slot_mapping,
        block_tables=table.view(num_seqs, num_blocks),
        context_lens=ctx_lens,
        query_starts=query_starts,
        query_lens_list=list(query_lens),
        context_lens_list=list(context_lens),
        block_size=block_size,
        sliding_window=sliding_window,
        num_seqs=num_seqs,
        max_query_len=max_q,
        max_context_len=max_ctx,
    )
