"""`LinearWithLoRA`: a model's `Linear` plus the slot buffers of up to `max_loras` adapters.

It replaces the `Linear` in place and keeps the same parameters (same names in `state_dict`, still an
instance of `Linear`); the buffers (`ops/buffers.py`) stay out of the state dict. Which modules are
wrapped is `targets.py`'s call, which backend computes the LoRA term `ops.add_lora`'s.

A layer whose caller cannot pass the step's ForwardBatch (a transformers module calling `proj(x)`) reads
it from the `StepBinding` its base layer carries (`step_binding`), which the owning model sets per step.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch, StepBinding
from loraserve.config import LoRAConfig
from loraserve.layers.fused_moe import FusedMoE
from loraserve.layers.linear import Linear
from loraserve.lora import ops
from loraserve.lora.expert_layers import ExpertsWithLoRA, wrap_experts_for_lora
from loraserve.lora.ops.block_writer import BlockWriter
from loraserve.lora.ops.buffers import LoRABuffers
from loraserve.lora.targets import lora_target_modules
from loraserve.lora.vocab_layers import EmbeddingWithLoRA, HeadWithLoRA, wrap_vocab_for_lora
from loraserve.lora.weights import (
    ExpertLoRAWeights,
    LoRALayerWeights,
    ModuleLoRA,
    PackedLoRALayerWeights,
    VocabLoRAWeights,
)
from loraserve.native import huge_pages


class LinearWithLoRA(Linear):
    """y = x W^T + b + B[s] A[s] x (+ bias[s]) for each token, s being its slot in the step's mapping."""

    def __init__(
        self,
        base: Linear,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype | None = None,
        bias_enabled: bool = False,
        storage: Sequence[torch.Tensor] | None = None,
    ) -> None:
        # Adopt the base layer's parameters instead of allocating new ones (Linear.__init__ would).
        nn.Module.__init__(self)
        self.in_features = base.in_features
        self.output_sizes = list(base.output_sizes)
        self.out_features = base.out_features
        self.weight = base.weight
        self.bias = base.bias
        self.packed_weight = base.packed_weight
        self.kernel_weight = base.kernel_weight
        self.quant_parts = base.quant_parts
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        # Set (on the base layer) by models whose layers are called without the batch: the HF backend.
        self.step_binding: StepBinding | None = getattr(base, "step_binding", None)
        self.num_slices = len(self.output_sizes)
        # Not registered as nn buffers: `Module.to` would move them and leave the C kernel's
        # pointers (taken once, in LoRABuffers) dangling. They are allocated where the weight lives.
        self.lora_buffers = LoRABuffers.allocate(
            max_loras, max_lora_rank, self.in_features, self.slice_offsets(),
            dtype or base.weight.dtype, base.weight.device, bias_enabled, storage,
        )

    @property
    def lora_a_stacked(self) -> torch.Tensor:
        """[max_loras, num_slices * max_lora_rank, in]."""
        return self.lora_buffers.lora_a

    @property
    def lora_b_stacked(self) -> torch.Tensor:
        """[max_loras, out, num_slices * max_lora_rank]."""
        return self.lora_buffers.lora_b

    def reset_lora(self, slot: int, writer: BlockWriter | None = None) -> None:
        """Empty `slot`, zeroing only what its adapter wrote (the rest of the buffers is always zero).

        With a `writer`, the zeroing happens at its `flush` (batched with other layers' writes)."""
        self._check_slot(slot)
        self.lora_buffers.write(slot, [None] * self.num_slices, writer)

    def set_lora(self, slot: int, lora: ModuleLoRA, writer: BlockWriter | None = None) -> None:
        """Write one adapter's weights for this layer into `slot`, its scaling folded into B.

        Everything is validated before the first write, so a refused adapter leaves the slot as it was.
        With a `writer`, the copies happen at its `flush` (batched with other layers' writes).
        """
        self._check_slot(slot)
        self.lora_buffers.write(slot, self._slice_parts(lora), writer)

    def _check_slot(self, slot: int) -> None:
        if not 0 <= slot < self.max_loras:
            raise ValueError(f"slot {slot} is out of range for max_loras={self.max_loras}")

    def _slice_parts(self, lora: ModuleLoRA) -> list[LoRALayerWeights | None]:
        """The adapter's weights per output slice of this layer, each checked to fit."""
        offsets = self.slice_offsets()
        if isinstance(lora, ExpertLoRAWeights | VocabLoRAWeights):
            raise ValueError(f"{lora.module_name}: {type(lora).__name__} for a linear layer")
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
            if part.bias is not None and self.lora_buffers.bias is None:
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

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        y = self.base_forward(x)
        if batch is None and self.step_binding is not None:
            batch = self.step_binding.batch_for(x)
            lora = batch.lora if batch is not None else None
            if lora is not None and x.numel() != lora.num_tokens * self.in_features:
                # A module run on some of the step's tokens (an MoE expert): the mapping cannot apply.
                raise ValueError(
                    f"a LoRA layer was called on {x.numel() // max(self.in_features, 1)} rows in a step of "
                    f"{lora.num_tokens} tokens; only layers that see every token of the step take LoRA."
                )
        if batch is not None and batch.lora is not None:
            ops.add_lora(y, x, self.lora_buffers, batch.lora)
            ops.apply_dora(y, self.bias, self.lora_buffers, batch.lora)
        return y

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, max_loras={self.max_loras}, max_lora_rank={self.max_lora_rank}"


SlotLayer = LinearWithLoRA | ExpertsWithLoRA | EmbeddingWithLoRA | HeadWithLoRA  # what holds weights in slots


def wrap_model_for_lora(model: nn.Module, lora_config: LoRAConfig) -> dict[str, SlotLayer]:
    """Replace every LoRA-capable `Linear` of the model (those `lora_config.target_modules` names, when
    given) by a `LinearWithLoRA`, in place, give every MoE layer's experts (unless
    --lora-target-modules leaves out `experts`) an `ExpertsWithLoRA`, and wrap the vocab modules of
    models that offer them (`vocab_lora_modules()`: `EmbeddingWithLoRA`, `HeadWithLoRA`).

    Idempotent: layers already wrapped are kept. Returns the wrapped layers by full module name.
    """
    wrapped: dict[str, SlotLayer] = {}
    allowed = lora_config.target_modules
    packed: dict[str, list[str]] = dict(getattr(model, "packed_modules_mapping", {}) or {})
    to_wrap: list[tuple[str, Linear]] = []
    for name, module in lora_target_modules(model, lora_config.enable_tower_connector_lora).items():
        leaf = name.rpartition(".")[2]
        if allowed is not None and leaf not in allowed and not set(packed.get(leaf, ())) & set(allowed):
            continue  # --lora-target-modules leaves it without LoRA (a packed one stays if any part is named)
        if isinstance(module, LinearWithLoRA):
            wrapped[name] = module
        else:
            to_wrap.append((name, module))
    for (name, module), storage in zip(to_wrap, _slot_storage([m for _, m in to_wrap], lora_config), strict=True):
        layer = LinearWithLoRA(
            module,
            max_loras=lora_config.max_loras,
            max_lora_rank=lora_config.max_lora_rank,
            dtype=lora_config.lora_dtype,
            bias_enabled=lora_config.enable_lora_bias,
            storage=storage,
        )
        parent_name, _, leaf = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        setattr(parent, leaf, layer)
        wrapped[name] = layer
    if allowed is None or "experts" in allowed:
        experts = {name: m for name, m in model.named_modules() if isinstance(m, FusedMoE)}
        wrapped.update(
            wrap_experts_for_lora(experts, lora_config.max_loras, lora_config.max_lora_rank, lora_config.lora_dtype)
        )
    vocab_modules = getattr(model, "vocab_lora_modules", None)
    vocab = list(vocab_modules()) if callable(vocab_modules) else []
    vocab = [n for n in vocab if allowed is None or n.rpartition(".")[2] in allowed]
    wrapped.update(
        wrap_vocab_for_lora(
            model, vocab, lora_config.max_loras, lora_config.max_lora_rank, lora_config.lora_dtype
        )
    )
    return wrapped


def _slot_storage(modules: list[Linear], lora_config: LoRAConfig) -> list[Sequence[torch.Tensor] | None]:
    """Each layer's A and B slot buffers, all from one allocation on huge pages when every layer is on
    the CPU (a decode step reads the slots of every adapter in the batch, layer after layer); None
    (each layer allocates its own) elsewhere."""
    if not modules or any(m.weight.device.type != "cpu" for m in modules):
        return [None] * len(modules)
    specs = [(shape, lora_config.lora_dtype or m.weight.dtype) for m in modules
             for shape in LoRABuffers.shapes(lora_config.max_loras, lora_config.max_lora_rank, m.in_features,
                                             m.slice_offsets())]
    tensors = huge_pages.zeros(specs, "cpu", touch=True)  # slot writes must not wait on page faults
    return [tensors[2 * i : 2 * i + 2] for i in range(len(modules))]
