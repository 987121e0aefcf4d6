"""LoRA-capable linear layers: which modules of a model take LoRA, and the slot-stacked wrapper.

`LinearWithLoRA` replaces a model's `Linear` in place and keeps the same parameters (same names in
`state_dict`, still an instance of `Linear`), plus per-slot buffers for up to `max_loras` adapters.

Packed layers (qkv_proj = [q, k, v], gate_up_proj = [gate, up]) are stored block-diagonally so one
shrink and one expand serve every slice: A is [L, n*R, in] with slice i's A in rows [i*R, i*R+r_i),
B is [L, out, n*R] with slice i's B in output rows of slice i and columns [i*R, i*R+r_i), zeros
elsewhere. On CPU the op count, not the FLOPs, dominates a decode step, so two ops per layer beat
2 * n ops; the zero blocks cost (n-1)/n of the expand FLOPs, a few percent of the base layer.
B is kept as [L, n*R, out] in memory (exposed as its [L, out, n*R] transpose) because `bmm` over
that layout is ~2x faster on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.config import LoRAConfig
from loraserve.layers.linear import Linear
from loraserve.lora.ops import add_lora, cpu_ops
from loraserve.lora.ops.cpu_ops import LoRASlices
from loraserve.lora.slot_writer import SlotWriter
from loraserve.lora.weights import LoRALayerWeights, ModuleLoRA, PackedLoRALayerWeights

# Linear modules that never take LoRA: the vocab projection (served from the base model only).
UNSUPPORTED_LEAF_NAMES = frozenset({"lm_head"})


@dataclass(frozen=True)
class LoRATargets:
    """The LoRA-capable modules of a model.

    modules:     full module name -> Linear (a LinearWithLoRA once wrapped).
    sub_modules: checkpoint sub-module name -> (packed module name, slice index), e.g.
                 "model.layers.0.self_attn.k_proj" -> ("model.layers.0.self_attn.qkv_proj", 1).
    """

    modules: dict[str, Linear]
    sub_modules: dict[str, tuple[str, int]]

    @classmethod
    def from_model(cls, model: nn.Module) -> LoRATargets:
        packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
        modules = lora_target_modules(model)
        sub_modules: dict[str, tuple[str, int]] = {}
        for name, module in modules.items():
            prefix, _, leaf = name.rpartition(".")
            subs = packed.get(leaf)
            if subs and len(subs) == len(module.output_sizes):
                for i, sub in enumerate(subs):
                    sub_modules[f"{prefix}.{sub}" if prefix else sub] = (name, i)
        return cls(modules=modules, sub_modules=sub_modules)

    def supported_leaf_names(self) -> list[str]:
        """Module names an adapter may target (e.g. q_proj, v_proj, qkv_proj, down_proj)."""
        names = {n.rpartition(".")[2] for n in self.modules} | {
            n.rpartition(".")[2] for n in self.sub_modules
        }
        return sorted(names)


def lora_target_modules(model: nn.Module) -> dict[str, Linear]:
    """Every `Linear` of the model that can take LoRA, by full module name."""
    return {
        name: module
        for name, module in model.named_modules()
        if isinstance(module, Linear) and name.rpartition(".")[2] not in UNSUPPORTED_LEAF_NAMES
    }


@dataclass(slots=True)
class _SlotState:
    """Per-slot bookkeeping of a LinearWithLoRA, kept out of nn.Module's slow attribute machinery.

    active_mask / bias_mask: bit s set when the adapter in slot s has A/B (a bias) in this layer.
    ranks: ranks[s][q], the rank written in slot s for slice q (what a later write must zero).
    """

    ranks: list[list[int]]
    active_mask: int = 0
    bias_mask: int = 0


class LinearWithLoRA(Linear):
    """A `Linear` plus `max_loras` adapter slots: y = x W^T + b + B[s] A[s] x (+ bias[s]) per token."""

    lora_a_stacked: torch.Tensor
    _lora_b_t: torch.Tensor
    lora_bias_stacked: torch.Tensor | None

    def __init__(
        self,
        base: Linear,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype | None = None,
        bias_enabled: bool = False,
    ) -> None:
        # Adopt the base layer's parameters instead of allocating new ones (Linear.__init__ would).
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.output_sizes = list(base.output_sizes)
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.packed_weight = base.packed_weight
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.num_slices = len(self.output_sizes)
        lora_dtype = dtype or base.weight.dtype
        device = base.weight.device
        stacked_rank = self.num_slices * max_lora_rank
        shape_a = (max_loras, stacked_rank, self.in_features)
        shape_b = (max_loras, stacked_rank, self.out_features)
        self.register_buffer(
            "lora_a_stacked", torch.zeros(shape_a, dtype=lora_dtype, device=device), persistent=False
        )
        self.register_buffer(
            "_lora_b_t", torch.zeros(shape_b, dtype=lora_dtype, device=device), persistent=False
        )
        bias_shape = (max_loras, self.out_features)
        self.register_buffer(
            "lora_bias_stacked",
            torch.zeros(bias_shape, dtype=lora_dtype, device=device) if bias_enabled else None,
            persistent=False,
        )
        # Per slot: does the adapter there touch this layer / carry a bias? Lets forward skip work.
        self._state = _SlotState(ranks=[[0] * self.num_slices for _ in range(max_loras)])
        self._offsets = self.slice_offsets()
        self._kernel_args: tuple[int, int, tuple[int, ...] | None] | None = None
        # Rank per (slot, slice): the fused CPU kernel reads only these blocks of the buffers.
        self.lora_slices = LoRASlices(
            offsets=torch.tensor(self.slice_offsets(), dtype=torch.long),
            ranks=torch.zeros(max_loras, self.num_slices, dtype=torch.int32),
            max_rank=max_lora_rank,
        )

    @property
    def lora_b_stacked(self) -> torch.Tensor:
        """[max_loras, out, num_slices * max_lora_rank] view of the B buffers."""
        return self._lora_b_t.transpose(1, 2)

    def reset_lora(self, slot: int, writer: SlotWriter | None = None) -> None:
        """Empty `slot`, zeroing only what its adapter wrote (the rest of the buffers is always zero).

        With a `writer`, the zeroing happens at its `flush` (batched with other layers' writes)."""
        self._check_slot(slot)
        self._write_slices(slot, [None] * self.num_slices, writer)

    def set_lora(self, slot: int, lora: ModuleLoRA, writer: SlotWriter | None = None) -> None:
        """Write one adapter's weights for this layer into `slot`, its scaling folded into B.

        Everything is validated before the first write, so a refused adapter leaves the slot as it was.
        With a `writer`, the copies happen at its `flush` (batched with other layers' writes).
        """
        self._check_slot(slot)
        self._write_slices(slot, self._slice_parts(lora), writer)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is out of range for max_loras={self.max_loras}")

    def _slice_parts(self, lora: ModuleLoRA) -> list[LoRALayerWeights | None]:
        """The adapter's weights per output slice of this layer, each checked to fit."""
        offsets = self._offsets
        if isinstance(lora, PackedLoRALayerWeights):
            if len(lora.slices) != self.num_slices:
                raise ValueError(
                    f"{lora.module_name}: adapter has {len(lora.slices)} slices, layer has {self.num_slices}"
                )
            parts = list(lora.slices)
        elif self.num_slices == 1:
            parts = [lora]
        else:
            # A packed layer targeted as a whole (one A, one B over every slice): B @ A x splits by
            # output rows into B_i @ A x, so each slice gets the same A and its rows of B. The
            # buffers then keep one layout, block-diagonal by slice, whatever the adapter targets.
            self._check_fits(lora, self.out_features)
            parts = [lora.row_slice(offsets[i], offsets[i + 1]) for i in range(self.num_slices)]
        for i, part in enumerate(parts):
            if part is None:
                continue
            self._check_fits(part, offsets[i + 1] - offsets[i])
            if part.bias is not None and self.lora_bias_stacked is None:
                raise ValueError(f"{part.module_name}: the adapter has a bias but --enable-lora-bias is off")
        return parts

    def _check_fits(self, lora: LoRALayerWeights, out_features: int) -> None:
        # Full shapes, not just in/out: the batched slot writes read the sources through raw pointers.
        shapes = (tuple(lora.lora_a.shape), tuple(lora.lora_b.shape),
                  None if lora.bias is None else tuple(lora.bias.shape))
        expected = ((lora.rank, self.in_features), (out_features, lora.rank),
                    None if lora.bias is None else (out_features,))
        if shapes != expected or not 0 <= lora.rank <= self.max_lora_rank:
            raise ValueError(
                f"{lora.module_name}: LoRA with A {shapes[0]}, B {shapes[1]}, bias {shapes[2]} and "
                f"rank={lora.rank} does not fit a layer slice of out={out_features}, in={self.in_features}, "
                f"max_lora_rank={self.max_lora_rank}"
            )

    def _write_slices(self, slot: int, parts: list[LoRALayerWeights | None], writer: SlotWriter | None) -> None:
        """Write each slice's rows, then zero the rows the previous occupant had beyond them."""
        own_writer = writer is None
        out = SlotWriter() if writer is None else writer
        state, offsets, max_rank = self._state, self._offsets, self.max_lora_rank
        old_ranks = state.ranks[slot]
        new_ranks = [part.rank if part is not None else 0 for part in parts]
        a_buf, b_buf = self.lora_a_stacked, self._lora_b_t
        for q, (part, old, new) in enumerate(zip(parts, old_ranks, new_ranks)):
            row, lo, hi = q * max_rank, offsets[q], offsets[q + 1]
            if part is not None and new:
                out.write(a_buf, slot, row, new, 0, self.in_features, part.lora_a)
                out.write(b_buf, slot, row, new, lo, hi, part.lora_b, part.scaling, transposed=True)
            if old > new:
                out.write(a_buf, slot, row + new, old - new, 0, self.in_features, None)
                out.write(b_buf, slot, row + new, old - new, lo, hi, None)
        bit = 1 << slot
        has_bias = any(part is not None and part.bias is not None for part in parts)
        if self.lora_bias_stacked is not None and (has_bias or state.bias_mask & bit):
            self.lora_bias_stacked[slot].zero_()
            for q, part in enumerate(parts):
                if part is not None and part.bias is not None:
                    self.lora_bias_stacked[slot, offsets[q] : offsets[q + 1]].copy_(part.bias)
        if own_writer:
            out.flush()
        if new_ranks != old_ranks:
            self.lora_slices.ranks[slot] = torch.tensor(new_ranks, dtype=torch.int32)
            state.ranks[slot] = new_ranks
        state.active_mask = state.active_mask | bit if any(new_ranks) else state.active_mask & ~bit
        state.bias_mask = state.bias_mask | bit if has_bias else state.bias_mask & ~bit

    def forward(self, x: torch.Tensor, batch: object | None = None) -> torch.Tensor:
        y = self.base_forward(x)
        mapping = getattr(batch, "lora", None)
        if mapping is None:
            return y
        use_ab = self._state.active_mask & mapping.active_mask
        use_bias = self._state.bias_mask & mapping.active_mask
        if not (use_ab or use_bias):
            return y
        x2, y2 = x.reshape(-1, self.in_features), y.view(-1, self.out_features)
        lora_dtype = self.lora_a_stacked.dtype
        same_dtype = lora_dtype == y.dtype
        delta = y2 if same_dtype else torch.zeros(y2.shape, dtype=lora_dtype, device=y2.device)
        if use_ab:
            x2 = x2.to(lora_dtype)
            args = self._cpu_kernel_args()
            if args is not None and cpu_ops.applies(x2, delta, mapping):
                cpu_ops.run(x2, delta, args, mapping)
            else:
                add_lora(delta, x2, self.lora_a_stacked, self.lora_b_stacked, mapping)
        if use_bias:
            assert self.lora_bias_stacked is not None
            # Row max_loras of the padded table is zero: tokens without an adapter add nothing.
            table = F.pad(self.lora_bias_stacked, (0, 0, 0, 1))
            rows = torch.where(mapping.token_slots < 0, self.max_loras, mapping.token_slots)
            delta.add_(table.index_select(0, rows))
        if not same_dtype:
            y2.add_(delta.to(y2.dtype))
        return y

    def _cpu_kernel_args(self) -> tuple[int, ...] | None:
        """The fused CPU kernel's per-layer arguments, recomputed only if the buffers moved."""
        a_ptr = self.lora_a_stacked.data_ptr()
        cached = self._kernel_args
        if cached is None or cached[0] != a_ptr or cached[1] != self._lora_b_t.data_ptr():
            args = cpu_ops.layer_args(self.lora_a_stacked, self._lora_b_t, self.lora_slices)
            cached = (a_ptr, self._lora_b_t.data_ptr(), args)
            self._kernel_args = cached
        return cached[2]

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_loras={self.max_loras}, max_lora_rank={self.max_lora_rank}"


def wrap_model_for_lora(model: nn.Module, lora_config: LoRAConfig) -> dict[str, LinearWithLoRA]:
    """Replace every LoRA-capable `Linear` of the model by a `LinearWithLoRA`, in place.

    Idempotent: layers already wrapped are kept. Returns the wrapped layers by full module name.
    """
    wrapped: dict[str, LinearWithLoRA] = {}
    for name, module in lora_target_modules(model).items():
        if isinstance(module, LinearWithLoRA):
            wrapped[name] = module
            continue
        layer = LinearWithLoRA(
            module,
            max_loras=lora_config.max_loras,
            max_lora_rank=lora_config.max_lora_rank,
            dtype=lora_config.lora_dtype,
            bias_enabled=lora_config.enable_lora_bias,
        )
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, layer)
        wrapped[name] = layer
    return wrapped
