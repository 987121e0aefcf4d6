"""The per-step batch description handed explicitly to the model and every layer."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraserve.layers.attention import AttentionMetadata

if TYPE_CHECKING:
    from loraserve.lora.mapping import LoRABatchMapping


@dataclass(slots=True)
class ForwardBatch:
    """Attention indices plus the token -> LoRA-slot mapping (None when LoRA is off)."""

    attn: AttentionMetadata
    lora: LoRABatchMapping | None = None


@dataclass(frozen=True)
class KVCacheSpec:
    """Shape of the paged KV cache a model needs."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
