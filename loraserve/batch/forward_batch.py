"""The per-step batch description handed explicitly to the model and every layer."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.batch.attention_metadata import AttentionMetadata
from loraserve.batch.lora_mapping import LoRABatchMapping


@dataclass(slots=True)
class ForwardBatch:
    """Attention indices plus the token -> LoRA-slot mapping (None when LoRA is off).

    seq_lens: each sequence's length at this step, in batch order: all its known tokens (the whole
    prompt while a chunk of it is prefilled, prompt + generated while decoding); None: the context
    after the step (`attn.context_lens_list`). LongRoPE picks its factor set by it, as transformers
    does from the whole sequence it is given, so chunking a prompt does not change its rope.
    """

    attn: AttentionMetadata
    lora: LoRABatchMapping | None = None
    seq_lens: list[int] | None = None


@dataclass(slots=True)
class StepBinding:
    """The step's ForwardBatch for layers whose caller cannot pass it (transformers' modules call
    `linear(x)`). One per model instance, shared by its layers: the owning model sets `batch` right
    before its forward and clears it right after, so nothing outlives the step (no process state)."""

    batch: ForwardBatch | None = None
