"""Turns a scheduled step into tensors, runs the model once, and returns the logits rows to sample.

Owns the paged KV cache (allocated once) and builds the per-step metadata: flat input ids and
positions, attention indices, and the token -> LoRA-slot mapping. Sequences are ordered by adapter so
each adapter's tokens are contiguous for the multi-LoRA ops.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from loraserve.engine.scheduler import ScheduledSeq
from loraserve.engine.sequence import Sequence
from loraserve.layers.attention import build_attention_metadata
from loraserve.layers.forward_batch import ForwardBatch, KVCacheSpec


@dataclass(slots=True)
class PromptLogprobChunk:
    """Logits for prompt positions [start, start + rows) of `seq`, predicting tokens start+1..."""

    seq: Sequence
    start: int
    logits: torch.Tensor


@dataclass(slots=True)
class StepResult:
    sample_seqs: list[Sequence]  # sequences whose whole context is now computed: sample one token each
    logits: torch.Tensor  # [len(sample_seqs), vocab], float32 or the LM head's dtype (the sampler converts)
    prompt_chunks: list[PromptLogprobChunk]


def kv_cache_block_bytes(spec: KVCacheSpec, block_size: int, dtype: torch.dtype) -> int:
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * spec.num_layers * block_size * spec.num_kv_heads * spec.head_dim * elem


class ModelRunner:
    def __init__(
        self,
        model: Any,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int | None = None,
    ) -> None:
        self.model = model
        self.max_loras = max_loras
        self.block_size = block_size
        self.device = device
        self.spec: KVCacheSpec = self.model.kv_cache_spec()
        # The last step's LoRA mapping and the token slots it was built from: decode steps of an
        # unchanged batch reuse it (it is immutable, and its index tensors are only read).
        self._lora_mapping: tuple[tuple[int, ...], Any] | None = None
        shape = (num_blocks * block_size, self.spec.num_kv_heads, self.spec.head_dim)
        self.kv_caches = [
            (torch.zeros(shape, dtype=dtype, device=device), torch.zeros(shape, dtype=dtype, device=device))
            for _ in range(self.spec.num_layers)
        ]

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], lora_slots: dict[int, int] | None) -> StepResult:
        """Run one forward pass. `lora_slots` maps lora_id -> compute slot (None: LoRA off)."""
        if lora_slots is not None:
            # Base tokens first, then one contiguous segment per slot in slot order: a balanced
            # multi-adapter decode batch becomes a [slots, tokens] grid the LoRA ops use as a view.
            scheduled = sorted(scheduled, key=lambda s: lora_slots.get(s.seq.lora_id, -1))
        input_ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        query_lens, context_lens, block_tables = [], [], []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            query_lens.append(item.num_new_tokens)
            context_lens.append(end)
            block_tables.append(seq.block_ids)
            if lora_slots is not None:
                slot = lora_slots[seq.lora_id] if seq.lora_id else -1
                token_slots.extend([slot] * item.num_new_tokens)

        attn = build_attention_metadata(
            query_lens, context_lens, block_tables, self.block_size, self.device, self.spec.sliding_window
        )
        lora = None
        if lora_slots is not None:
            from loraserve.lora.mapping import LoRABatchMapping

            key = tuple(token_slots)
            if self._lora_mapping is None or self._lora_mapping[0] != key:
                self._lora_mapping = (key, LoRABatchMapping.build(token_slots, self.device, max_loras=self.max_loras))
            lora = self._lora_mapping[1]
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            ForwardBatch(attn=attn, lora=lora),
        )
        return self._select_logits(scheduled, hidden)

    def _select_logits(self, scheduled: list[ScheduledSeq], hidden: torch.Tensor) -> StepResult:
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        prompt_spans: list[tuple[Sequence, int, int, int]] = []  # seq, first row, num rows, start position
        offset = 0
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                rows = min(n, seq.num_prompt_tokens - 1 - start)
                prompt_spans.append((seq, offset, rows, start))
            if start + n == seq.num_tokens:
                sample_rows.append(offset + n - 1)
                sample_seqs.append(seq)
            offset += n
        logits = self.model.compute_logits(hidden[sample_rows], float32=False) if sample_rows \
            else hidden.new_empty(0, 0)
        chunks = [
            PromptLogprobChunk(seq, start, self.model.compute_logits(hidden[first : first + rows]))
            for seq, first, rows, start in prompt_spans
        ]
        return StepResult(sample_seqs, logits, chunks)
