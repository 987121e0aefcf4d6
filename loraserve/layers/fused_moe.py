"""Mixture-of-experts layers: top-k routing and the experts, batched by expert.

`route` turns router logits into each token's top-k experts and their weights (softmax in float32,
then top-k, renormalised over the chosen k where the config asks: Mixtral always, Qwen-MoE and OLMoE
by `norm_topk_prob`). `FusedMoE` keeps every expert's weights stacked, `w13 [E, 2I, H]` (gate rows,
then up rows) and `w2 [E, H, I]`, and runs a step as: sort the (token, expert) pairs by expert, one
gate_up product and one down product per expert over its rows (a loop over experts, never over
tokens), SiLU-and-mul on all rows at once, the routing weights applied, and one `index_add_` back to
the tokens. An expert LoRA (`ExpertLoRA`, set by the LoRA layer) adds its term per pair, so an
adapter's expert weights reach only the tokens routed to that expert.
"""

from __future__ import annotations

from typing import Protocol

import torch
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch
from loraserve.layers.fused_cpu import silu_and_mul

GATE_UP, DOWN = "gate_up_proj", "down_proj"
# Per-expert checkpoint names -> (stacked parameter, row block: 0 gate, 1 up, None the whole matrix).
EXPERT_LEAVES: dict[str, tuple[str, int | None]] = {
    "w1": (GATE_UP, 0),  # Mixtral's published layout
    "w3": (GATE_UP, 1),
    "w2": (DOWN, None),
    "gate_proj": (GATE_UP, 0),  # Qwen-MoE's and OLMoE's
    "up_proj": (GATE_UP, 1),
    "down_proj": (DOWN, None),
}


def route(
    logits: torch.Tensor, top_k: int, renormalize: bool, weights_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights [T, k] in `weights_dtype`, expert ids [T, k]) of router logits [T, E]: softmax in
    float32, the k largest, divided by their sum when `renormalize`."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(weights_dtype), ids


class ExpertLoRA(Protocol):
    """What `FusedMoE` asks of an expert LoRA: the term to add to one projection's rows."""

    def add_term(
        self,
        stage: str,
        out: torch.Tensor,
        rows: torch.Tensor,
        counts: list[int],
        tokens: torch.Tensor,
        batch: ForwardBatch,
    ) -> None:
        """out[i] += the LoRA term of `stage` (GATE_UP or DOWN) on rows[i], rows sorted by expert
        (counts[e] of them expert e's), with the adapter of token tokens[i] in the step's `batch`."""


class FusedMoE(nn.Module):
    """The experts of one MoE layer, stacked, with SiLU gating."""

    def __init__(
        self, num_experts: int, hidden_size: int, intermediate_size: int, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_experts, self.hidden_size, self.intermediate_size = (
            num_experts,
            hidden_size,
            intermediate_size,
        )
        shape13 = (num_experts, 2 * intermediate_size, hidden_size)
        self.gate_up_proj = nn.Parameter(torch.empty(shape13, dtype=dtype), requires_grad=False)
        self.down_proj = nn.Parameter(
            torch.empty(num_experts, hidden_size, intermediate_size, dtype=dtype), requires_grad=False
        )
        self.lora: ExpertLoRA | None = None  # set by the LoRA layer when adapters may target experts
        self._loaded: set[tuple[str, int, int | None]] = set()

    def load_fused(self, leaf: str, tensor: torch.Tensor) -> None:
        """A checkpoint's stacked tensor (transformers' layout): `gate_up_proj` [E, 2I, H] or `down_proj`
        [E, H, I]."""
        param = self._param(leaf)
        _check_shape(f"experts.{leaf}", tuple(param.shape), tuple(tensor.shape))
        param.data.copy_(tensor)
        self._loaded.update((leaf, e, b) for e in range(self.num_experts) for b in _blocks(leaf))

    def load_expert(self, expert: int, leaf: str, tensor: torch.Tensor) -> None:
        """One expert's checkpoint matrix (`w1`/`w3`/`w2` or `gate_proj`/`up_proj`/`down_proj`)."""
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"checkpoint has expert {expert}, the model {self.num_experts} experts")
        if leaf not in EXPERT_LEAVES:
            raise ValueError(f"checkpoint tensor experts.{expert}.{leaf} is no expert matrix")
        target, block = EXPERT_LEAVES[leaf]
        rows = self._param(target).data[expert]
        if block is not None:
            rows = rows[block * self.intermediate_size : (block + 1) * self.intermediate_size]
        _check_shape(f"experts.{expert}.{leaf}", tuple(rows.shape), tuple(tensor.shape))
        rows.copy_(tensor)
        self._loaded.add((target, expert, block))

    def fully_loaded(self) -> bool:
        return len(self._loaded) == 3 * self.num_experts

    def _param(self, leaf: str) -> nn.Parameter:
        if leaf not in (GATE_UP, DOWN):
            raise ValueError(f"checkpoint tensor experts.{leaf} is no expert matrix")
        return self.gate_up_proj if leaf == GATE_UP else self.down_proj

    def forward(
        self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, batch: ForwardBatch | None = None
    ) -> torch.Tensor:
        """x [T, H], routing weights and expert ids [T, k] -> sum_j weights[t, j] * expert_{ids[t, j]}(x_t)."""
        num_tokens, top_k = ids.shape
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        tokens = torch.div(order, top_k, rounding_mode="floor")
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()
        rows = x.index_select(0, tokens)
        gate_up = self._per_expert(rows, self.gate_up_proj, counts)
        lora = self.lora if batch is not None and batch.lora is not None and batch.lora.has_lora else None
        if lora is not None and batch is not None:
            lora.add_term(GATE_UP, gate_up, rows, counts, tokens, batch)
        hidden = silu_and_mul(gate_up)
        down = self._per_expert(hidden, self.down_proj, counts)
        if lora is not None and batch is not None:
            lora.add_term(DOWN, down, hidden, counts, tokens, batch)
        # The weights multiply in their own dtype (Mixtral's stay float32, as transformers keeps them).
        scaled = (down * weights.reshape(-1).index_select(0, order).unsqueeze(1)).to(x.dtype)
        out = torch.zeros(num_tokens, self.hidden_size, dtype=x.dtype, device=x.device)
        return out.index_add_(0, tokens, scaled)

    @staticmethod
    def _per_expert(rows: torch.Tensor, stacked: torch.Tensor, counts: list[int]) -> torch.Tensor:
        """rows [P, in] sorted by expert, counts[e] of them expert e's -> rows @ stacked[e]^T per block."""
        out = rows.new_empty(rows.shape[0], stacked.shape[1])
        start = 0
        for expert, count in enumerate(counts):
            if count:
                end = start + count
                torch.mm(rows[start:end], stacked[expert].t(), out=out[start:end])
                start = end
        return out

    def extra_repr(self) -> str:
        return f"experts={self.num_experts}, hidden={self.hidden_size}, intermediate={self.intermediate_size}"


def _blocks(leaf: str) -> tuple[int | None, ...]:
    return (0, 1) if leaf == GATE_UP else (None,)


def _check_shape(name: str, model: tuple[int, ...], checkpoint: tuple[int, ...]) -> None:
    if model != checkpoint:
        raise ValueError(f"shape mismatch for {name}: model {model}, checkpoint {checkpoint}")
