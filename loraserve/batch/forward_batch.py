"""The per-step batch description handed explicitly to the model and every layer."""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.batch.attention_metadata import AttentionMetadata
from loraserve.batch.lora_mapping import LoRABatchMapping


@dataclass(slots=True)
class ForwardBatch:
    """Attention indices plus the token -> LoRA-slot mapping (None when LoRA is off)."""

    attn: AttentionMetadata
    lora: LoRABatchMapping | None = None


@dataclass(slots=True)
class StepBinding:
    """The step's ForwardBatch for layers whose caller cannot pass it (transformers' modules call
    `linear(x)`). One per model instance, shared by its layers: the owning model sets `batch` right
    before its forward and clears it right after, so nothing outlives the step (no process state)."""

    batch: ForwardBatch | None = None
