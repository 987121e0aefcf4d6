"""`ExpertsWithLoRA`: the slot buffers of up to `max_loras` adapters on one MoE layer's experts.

PEFT trains LoRA on the stacked expert tensors (`target_parameters` on `experts.gate_up_proj` and
`experts.down_proj`): one (A, B) pair per expert, so an expert's adapter reaches only the rows routed
to it. `FusedMoE` hands each projection's rows, sorted by expert, to `add_term`; per expert it runs
one product with the A blocks of every slot, keeps each row's own slot block (a mask: rows without an
adapter keep none), and one product with the B blocks, added to the base output. Per expert, slot s
holds rows [s * R, (s + 1) * R) of `a [E, S * R, in]` and columns of `b [E, out, S * R]`, R the
max rank, zero past the adapter's rank and for absent adapters; the scaling is folded into B. Plain
torch ops (the C LoRA kernel serves the `Linear` layers). Not an `nn.Module`: the buffers stay out
of the state dict, as `LinearWithLoRA`'s do.
"""

from __future__ import annotations

import torch

from loraserve.batch.forward_batch import ForwardBatch
from loraserve.layers.fused_moe import DOWN, GATE_UP, FusedMoE
from loraserve.lora.ops.block_writer import BlockWriter
from loraserve.lora.weights import ExpertLoRAWeights, ModuleLoRA


class ExpertsWithLoRA:
    """The experts' LoRA slots; `FusedMoE.lora` points here once the model is wrapped."""

    def __init__(
        self, experts: FusedMoE, max_loras: int, max_lora_rank: int, dtype: torch.dtype | None
    ) -> None:
        self.experts, self.max_loras, self.max_lora_rank = experts, max_loras, max_lora_rank
        dtype = dtype or experts.gate_up_proj.dtype
        device = experts.gate_up_proj.device
        width = max_loras * max_lora_rank
        num, hidden, size = experts.num_experts, experts.hidden_size, experts.intermediate_size
        self.shapes = {GATE_UP: (hidden, 2 * size), DOWN: (size, hidden)}  # (in, out) per projection
        self.a = {
            k: torch.zeros(num, width, i, dtype=dtype, device=device) for k, (i, _) in self.shapes.items()
        }
        self.b = {
            k: torch.zeros(num, o, width, dtype=dtype, device=device) for k, (_, o) in self.shapes.items()
        }
        self.held = {stage: [False] * max_loras for stage in self.shapes}  # slots with weights, per stage
        experts.lora = self

    def reset_lora(self, slot: int, writer: BlockWriter | None = None) -> None:
        """Empty `slot` (written at once: the expert buffers take no part in the batched writes)."""
        self._check_slot(slot)
        for stage in self.shapes:
            self._zero(stage, slot)

    def set_lora(self, slot: int, lora: ModuleLoRA, writer: BlockWriter | None = None) -> None:
        """Write one adapter's expert weights into `slot`; checked in full before the first write."""
        self._check_slot(slot)
        if not isinstance(lora, ExpertLoRAWeights):
            raise ValueError(f"{lora.module_name}: the experts of an MoE layer take expert LoRA weights only")
        for stage, (lora_a, lora_b) in lora.stages.items():
            fan_in, fan_out = self.shapes[stage]
            rank = int(lora_a.shape[1])
            expected = ((self.experts.num_experts, rank, fan_in), (self.experts.num_experts, fan_out, rank))
            if (tuple(lora_a.shape), tuple(lora_b.shape)) != expected or rank > self.max_lora_rank:
                raise ValueError(
                    f"{lora.module_name}.{stage}: LoRA with A {tuple(lora_a.shape)} and B {tuple(lora_b.shape)} "
                    f"does not fit {self.experts.num_experts} experts of in={fan_in}, out={fan_out}, "
                    f"max_lora_rank={self.max_lora_rank} (per-expert gate and up adapters stack to twice their "
                    "rank on gate_up_proj, as in PEFT; a larger --max-lora-rank serves them)"
                )
        for stage in self.shapes:
            self._zero(stage, slot)
            if stage in lora.stages:
                lora_a, lora_b = lora.stages[stage]
                start, rank = slot * self.max_lora_rank, int(lora_a.shape[1])
                self.a[stage][:, start : start + rank].copy_(lora_a)
                self.b[stage][:, :, start : start + rank].copy_(lora_b)
                self.held[stage][slot] = True

    def _zero(self, stage: str, slot: int) -> None:
        if self.held[stage][slot]:
            start, end = slot * self.max_lora_rank, (slot + 1) * self.max_lora_rank
            self.a[stage][:, start:end].zero_()
            self.b[stage][:, :, start:end].zero_()
            self.held[stage][slot] = False

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is out of range for max_loras={self.max_loras}")

    def add_term(
        self,
        stage: str,
        out: torch.Tensor,
        rows: torch.Tensor,
        counts: list[int],
        tokens: torch.Tensor,
        batch: ForwardBatch,
    ) -> None:
        mapping = batch.lora
        if mapping is None or not any(self.held[stage][s] for s in mapping.active_slots):
            return  # no adapter of the step has weights for this projection
        a, b = self.a[stage], self.b[stage]
        slots = mapping.token_slots.index_select(0, tokens)  # each row's slot, -1 for none
        x = rows.to(a.dtype)
        shrunk = x.new_empty(x.shape[0], a.shape[1])
        _per_expert(x, a, counts, shrunk)
        own = slots.unsqueeze(1) == torch.arange(self.max_loras, device=slots.device)  # [P, S]
        shrunk.view(x.shape[0], self.max_loras, self.max_lora_rank).mul_(own.unsqueeze(-1).to(a.dtype))
        if mapping.scales is not None:  # per-request scales: each row's t = A x times its token's scale
            shrunk.mul_(mapping.scales.by_token.index_select(0, tokens).to(a.dtype))
        delta = x.new_empty(x.shape[0], b.shape[1])
        _per_expert(shrunk, b, counts, delta)
        out.add_(delta.to(out.dtype))


def _per_expert(rows: torch.Tensor, stacked: torch.Tensor, counts: list[int], out: torch.Tensor) -> None:
    start = 0
    for expert, count in enumerate(counts):
        if count:
            torch.mm(rows[start : start + count], stacked[expert].t(), out=out[start : start + count])
            start += count


def wrap_experts_for_lora(
    experts: dict[str, FusedMoE], max_loras: int, max_lora_rank: int, dtype: torch.dtype | None
) -> dict[str, ExpertsWithLoRA]:
    """An `ExpertsWithLoRA` on each MoE layer's experts (kept where one is already set), by module name."""
    out = {}
    for name, module in experts.items():
        lora = module.lora
        out[name] = (
            lora
            if isinstance(lora, ExpertsWithLoRA)
            else ExpertsWithLoRA(module, max_loras, max_lora_rank, dtype)
        )
    return out
