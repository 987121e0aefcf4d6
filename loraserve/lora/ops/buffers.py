"""`LoRABuffers`: one LoRA layer's slot-stacked adapter weights, their layout, and what each slot holds.

Packed layers (qkv_proj = [q, k, v], gate_up_proj = [gate, up]) are stored block-diagonally so one
shrink and one expand serve every slice: A is [L, n*R, in] with slice i's A in rows [i*R, i*R+r_i),
B is [L, out, n*R] with slice i's B in output rows of slice i and columns [i*R, i*R+r_i), zeros
elsewhere. On CPU the op count, not the FLOPs, dominates a decode step, so two ops per layer beat
2 * n ops; the zero blocks cost (n-1)/n of the expand FLOPs, a few percent of the base layer.
B is kept as [L, n*R, out] in memory (exposed as its [L, out, n*R] transpose) because `bmm` over
that layout is ~2x faster on CPU. Every write zeroes exactly what the slot's previous adapter wrote
beyond the new ranks, so the blocks outside the ranks are always zero.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from loraserve.lora.ops import lora_cpu
from loraserve.lora.ops.block_writer import BlockWriter
from loraserve.lora.weights import LoRALayerWeights


@dataclass(slots=True)
class LoRABuffers:
    """The adapters of up to L slots for one layer of n output slices, at most rank R per slice.

    lora_a:        [L, n*R, in].
    lora_b_t:      [L, n*R, out], the storage of B (`lora_b` is its [L, out, n*R] view).
    bias:          [L, out] per-slot bias added as is, or None when adapter biases are off.
    slice_offsets: [n + 1] int64 output offset of each slice (qkv: 0, q, q+k, q+k+v).
    ranks:         [L, n] int32 rank written in slot s for slice q (0: none); updated in place.
    dora:          [L + 1, out] float32 DoRA scale g per slot (1 where a slot's adapter is no DoRA
                   one; row L, for tokens without an adapter, always 1).
    active_mask / bias_mask / dora_mask: bit s set when the adapter in slot s has A/B (a bias, a DoRA
                   scale) here.
    cpu_kernel_args: the C kernel's per-layer arguments, set once (None: it cannot serve these).
    """

    lora_a: torch.Tensor
    lora_b_t: torch.Tensor
    bias: torch.Tensor | None
    slice_offsets: torch.Tensor
    ranks: torch.Tensor
    max_rank: int
    active_mask: int = 0
    bias_mask: int = 0
    dora_mask: int = 0
    dora: torch.Tensor | None = None
    cpu_kernel_args: lora_cpu.LayerArgs | None = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.dora is None:
            out_features = int(self.slice_offsets[-1])
            self.dora = torch.ones(self.lora_a.shape[0] + 1, out_features, device=self.lora_a.device)
        self.cpu_kernel_args = lora_cpu.layer_args(
            self.lora_a, self.lora_b_t, self.slice_offsets, self.ranks, self.max_rank
        )

    @staticmethod
    def shapes(max_loras: int, max_rank: int, in_features: int, slice_offsets: list[int]) -> list[torch.Size]:
        """The shapes of A's and B's buffers ([L, n*R, in] and [L, n*R, out])."""
        stacked = (len(slice_offsets) - 1) * max_rank
        return [torch.Size((max_loras, stacked, in_features)), torch.Size((max_loras, stacked, slice_offsets[-1]))]

    @classmethod
    def allocate(
        cls,
        max_loras: int,
        max_rank: int,
        in_features: int,
        slice_offsets: list[int],
        dtype: torch.dtype,
        device: torch.device,
        bias_enabled: bool,
        storage: Sequence[torch.Tensor] | None = None,
    ) -> LoRABuffers:
        """Zeroed buffers for `max_loras` slots of a layer whose outputs `slice_offsets` cut; `storage`
        gives A's and B's (zeroed, of `shapes(...)`: a model's layers take theirs from one allocation)."""
        num_slices, out_features = len(slice_offsets) - 1, slice_offsets[-1]
        lora_a, lora_b_t = storage if storage is not None else [
            torch.zeros(shape, dtype=dtype, device=device)
            for shape in cls.shapes(max_loras, max_rank, in_features, slice_offsets)]
        if (lora_a.shape, lora_b_t.shape) != tuple(cls.shapes(max_loras, max_rank, in_features, slice_offsets)) \
                or lora_a.dtype != dtype or lora_b_t.dtype != dtype:
            raise ValueError("LoRA buffer storage of the wrong shape or dtype")
        return cls(
            lora_a=lora_a,
            lora_b_t=lora_b_t,
            bias=torch.zeros(max_loras, out_features, dtype=dtype, device=device) if bias_enabled else None,
            slice_offsets=torch.tensor(slice_offsets, dtype=torch.long),
            ranks=torch.zeros(max_loras, num_slices, dtype=torch.int32),
            max_rank=max_rank,
        )

    def _write_dora(self, slot: int, parts: list[LoRALayerWeights | None], offsets: list[int]) -> None:
        """The slot's DoRA scales (1 for slices without one), or back to 1 for a non-DoRA adapter."""
        assert self.dora is not None
        bit = 1 << slot
        has_dora = any(part is not None and part.dora_scale is not None for part in parts)
        if has_dora or self.dora_mask & bit:
            self.dora[slot].fill_(1.0)
            for q, part in enumerate(parts):
                if part is not None and part.dora_scale is not None:
                    self.dora[slot, offsets[q] : offsets[q + 1]].copy_(part.dora_scale)
        self.dora_mask = self.dora_mask | bit if has_dora else self.dora_mask & ~bit

    @property
    def lora_b(self) -> torch.Tensor:
        """[L, out, n*R] view of the B buffers."""
        return self.lora_b_t.transpose(1, 2)

    @property
    def max_loras(self) -> int:
        return int(self.lora_a.shape[0])

    def write(self, slot: int, parts: list[LoRALayerWeights | None], writer: BlockWriter | None = None) -> None:
        """Put one adapter's slices (None: the slice untouched) in `slot`, scaling folded into B, and
        zero the rows the previous occupant had beyond them. Callers check that the parts fit. With a
        `writer`, the copies happen at its `flush` (batched with other layers' writes)."""
        out = BlockWriter() if writer is None else writer
        offsets, max_rank, in_features = self.slice_offsets.tolist(), self.max_rank, self.lora_a.shape[2]
        old_ranks = self.ranks[slot].tolist()
        new_ranks = [part.rank if part is not None else 0 for part in parts]
        for q, (part, old, new) in enumerate(zip(parts, old_ranks, new_ranks, strict=True)):
            row, lo, hi = q * max_rank, offsets[q], offsets[q + 1]
            if part is not None and new:
                out.write(self.lora_a, slot, row, new, 0, in_features, part.lora_a)
                out.write(self.lora_b_t, slot, row, new, lo, hi, part.lora_b, part.scaling, transposed=True)
            if old > new:
                out.write(self.lora_a, slot, row + new, old - new, 0, in_features, None)
                out.write(self.lora_b_t, slot, row + new, old - new, lo, hi, None)
        bit = 1 << slot
        has_bias = any(part is not None and part.bias is not None for part in parts)
        if self.bias is not None and (has_bias or self.bias_mask & bit):
            self.bias[slot].zero_()
            for q, part in enumerate(parts):
                if part is not None and part.bias is not None:
                    self.bias[slot, offsets[q] : offsets[q + 1]].copy_(part.bias)
        self._write_dora(slot, parts, offsets)
        if writer is None:
            out.flush()
        if new_ranks != old_ranks:
            # In place: the C kernel reads the ranks through a pointer taken once.
            self.ranks[slot] = torch.tensor(new_ranks, dtype=torch.int32)
        self.active_mask = self.active_mask | bit if any(new_ranks) else self.active_mask & ~bit
        self.bias_mask = self.bias_mask | bit if has_bias else self.bias_mask & ~bit
