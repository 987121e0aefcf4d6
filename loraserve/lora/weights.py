"""Per-module adapter weights: one module's A/B pair, the slices of a packed module, the stacked
per-expert pairs of an MoE layer's experts (PEFT's `target_parameters` on the fused expert tensors), or
what an adapter holds for a vocab module (the input embedding or the LM head: `VocabLoRAWeights`).

The scaling stays beside B; a slot write folds it in as it copies B (`ops/buffers.py`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class LoRALayerWeights:
    """delta(x) = scaling * lora_b @ lora_a @ x + bias for one module (or one slice of a packed one).

    lora_a: [rank, in]; lora_b: [out, rank] (nn.Linear orientation, as PEFT stores them, also for
    GPT-2's fan_in_fan_out Conv1D modules); bias: [out], added as is (already scaled) or None.
    rank 0 is a bias-only entry (a module whose base bias the adapter retrained).
    """

    module_name: str
    rank: int
    lora_a: torch.Tensor
    lora_b: torch.Tensor
    scaling: float
    bias: torch.Tensor | None = None
    dora_scale: torch.Tensor | None = None  # DoRA: float32 [out], y = g * (x W^T + delta) + b

    @property
    def in_features(self) -> int:
        return int(self.lora_a.shape[1])

    @property
    def out_features(self) -> int:
        return int(self.lora_b.shape[0])

    @property
    def num_bytes(self) -> int:
        tensors = [self.lora_a, self.lora_b] + [t for t in (self.bias, self.dora_scale) if t is not None]
        return sum(t.numel() * t.element_size() for t in tensors)

    def row_slice(self, start: int, end: int) -> LoRALayerWeights:
        """The same adapter restricted to output rows [start, end) (shares A; views of B and bias)."""
        bias = self.bias[start:end] if self.bias is not None else None
        dora = self.dora_scale[start:end] if self.dora_scale is not None else None
        return LoRALayerWeights(
            self.module_name, self.rank, self.lora_a, self.lora_b[start:end], self.scaling, bias, dora
        )


@dataclass(slots=True)
class PackedLoRALayerWeights:
    """Adapters for the output slices of one packed module (qkv_proj, gate_up_proj).

    `slices[i]` covers output slice i (e.g. q, k, v); None means the adapter leaves that slice alone
    (an adapter on q_proj and v_proj only contributes zero to the k slice).
    """

    module_name: str
    slices: list[LoRALayerWeights | None]

    @property
    def rank(self) -> int:
        return max((s.rank for s in self.slices if s is not None), default=0)

    @property
    def num_bytes(self) -> int:
        return sum(s.num_bytes for s in self.slices if s is not None)


@dataclass(slots=True)
class ExpertLoRAWeights:
    """An adapter's weights for one MoE layer's experts, by stacked parameter ("gate_up_proj",
    "down_proj"): (lora_a [E, rank, in], lora_b [E, out, rank]) with the scaling already folded into
    lora_b; expert e's term on a row routed to it is lora_b[e] @ lora_a[e] @ x."""

    module_name: str
    stages: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def rank(self) -> int:
        return max((int(a.shape[1]) for a, _ in self.stages.values()), default=0)

    @property
    def num_bytes(self) -> int:
        return sum(a.numel() * a.element_size() + b.numel() * b.element_size() for a, b in self.stages.values())


@dataclass(slots=True)
class VocabLoRAWeights:
    """An adapter's terms on a vocab module ("model.embed_tokens" or "lm_head"), each optional:

    lora:        a LoRA pair. On the embedding, PEFT's lora_embedding_A [r, vocab] as `lora_a` and
                 lora_embedding_B [hidden, r] as `lora_b`: token t's row gains scaling * B @ A[:, t].
                 On the head, a plain Linear pair (A [r, hidden], B [vocab, r]).
    token_ids /  PEFT's trainable tokens: rows `token_ids` (int64 [K], distinct) of the module's
    token_rows:  weight replaced by `token_rows` [K, hidden] (the embedding's rows, or the head's
                 logits of those tokens).
    full:        modules_to_save: the whole module's weight [vocab, hidden], replacing the base's.
    """

    module_name: str
    lora: LoRALayerWeights | None = None
    token_ids: torch.Tensor | None = None
    token_rows: torch.Tensor | None = None
    full: torch.Tensor | None = None

    @property
    def rank(self) -> int:
        return self.lora.rank if self.lora is not None else 0

    @property
    def replaces_rows(self) -> bool:
        """Whether it replaces weights (trainable tokens or a full module): no scale or mix applies."""
        return self.token_ids is not None or self.full is not None

    @property
    def num_bytes(self) -> int:
        tensors = [t for t in (self.token_ids, self.token_rows, self.full) if t is not None]
        own = sum(t.numel() * t.element_size() for t in tensors)
        return own + (self.lora.num_bytes if self.lora is not None else 0)


ModuleLoRA = LoRALayerWeights | PackedLoRALayerWeights | ExpertLoRAWeights | VocabLoRAWeights
