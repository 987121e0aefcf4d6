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
