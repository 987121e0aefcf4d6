"""The per-step batch description handed explicitly to the model and every layer."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from loraserve.batch.attention_metadata import AttentionMetadata
from loraserve.batch.lora_mapping import LoRABatchMapping


@dataclass(frozen=True, slots=True)
class EmbedOverlay:
    """Rows of the step's input embeddings that come from elsewhere than the token embedding (the
    image embeddings of a vision-language model at their placeholder tokens): `values[i]` replaces
    row `rows[i]` of the flat [T, hidden] batch. rows [K] int64, values [K, hidden]."""

    rows: torch.Tensor
    values: torch.Tensor

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        """x [T, hidden] with the overlay's rows replaced (in place; x is the step's own tensor)."""
        x.index_copy_(0, self.rows, self.values.to(x.dtype))
        return x


@dataclass(slots=True)
class ForwardBatch:
    """Attention indices plus the token -> LoRA-slot mapping (None when LoRA is off).

    seq_lens: each sequence's length at this step, in batch order: all its known tokens (the whole
    prompt while a chunk of it is prefilled, prompt + generated while decoding); None: the context
    after the step (`attn.context_lens_list`). LongRoPE picks its factor set by it, as transformers
    does from the whole sequence it is given, so chunking a prompt does not change its rope.
    embeds: image embeddings placed over their placeholder tokens' rows (None: text only).
    """

    attn: AttentionMetadata
    lora: LoRABatchMapping | None = None
    seq_lens: list[int] | None = None
    embeds: EmbedOverlay | None = None


@dataclass(slots=True)
class StepBinding:
    """The step's ForwardBatch for layers whose caller cannot pass it (transformers' modules call
    `linear(x)`). One per model instance, shared by its layers: the owning model sets `batch` right
    before its forward and clears it right after, so nothing outlives the step (no process state).

    A vision tower's layers see other row counts than the step's tokens (patches, then fewer merged
    ones), so a tower run for one adapter sets `uniform` instead: every row of every call takes that
    adapter (`UniformSlot`), its mapping built once per row count."""

    batch: ForwardBatch | None = None
    uniform: UniformSlot | None = None

    def batch_for(self, x: torch.Tensor) -> ForwardBatch | None:
        """The ForwardBatch a layer called on `x` ([..., in]) reads: the step's, or the uniform one's."""
        if self.uniform is None:
            return self.batch
        return self.uniform.batch(x.numel() // max(x.shape[-1], 1))


@dataclass(slots=True)
class UniformSlot:
    """One adapter slot (and scale) for every row: a vision tower's run for one adapter."""

    slot: int
    scale: float
    device: torch.device
    max_loras: int | None = None
    _batches: dict[int, ForwardBatch] = field(default_factory=dict)

    def batch(self, num_rows: int) -> ForwardBatch:
        found = self._batches.get(num_rows)
        if found is None:
            scales = None if self.scale == 1.0 else [self.scale] * num_rows
            mapping = LoRABatchMapping.build(
                [self.slot] * num_rows, self.device, max_loras=self.max_loras, token_scales=scales
            )
            found = self._batches[num_rows] = ForwardBatch(attn=None, lora=mapping)  # type: ignore[arg-type]
        return found
