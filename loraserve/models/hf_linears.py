"""The transformers backend's linear layers: each `nn.Linear` and GPT-2-style `Conv1D` of an HF model
becomes a loraserve `Linear` (`HFLinear`), so that the CPU linear kernels pack it and LoRA wraps it
like a native model's layer (`lora.layers.wrap_model_for_lora`, `LoRATargets.from_model`).

HF modules call `proj(x)` without the step's ForwardBatch; each `HFLinear` holds the owning model's
`StepBinding` (set around each forward), which its LoRA wrapper reads. Fused projections of the
checkpoint (Phi-3's `qkv_proj`, `gate_up_proj`) get their slices as `output_sizes`, and the model
declares the inverse mapping (`packed_modules_mapping`) so adapters on q/k/v or gate/up apply as
slices. Left as they are, hence refused by name if an adapter targets them: the output embeddings
(the vocab projection), MoE experts (run on the tokens routed to them, not the step's), and every
other module type (embeddings, fused expert tensors, subclasses of nn.Linear with their own forward).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch, StepBinding
from loraserve.layers.linear import Linear

# Fused HF modules whose output is their parts stacked in this order (Phi-3, Phi-3.5, Phi-4-mini).
FUSED_MODULES: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "gate_up_proj": ("gate_proj", "up_proj"),
}
_EXPERT_CONTAINERS = frozenset({"experts"})


class HFLinear(Linear):
    """A transformers linear module's parameters behind loraserve's `Linear` (weight [out, in])."""

    def __init__(
        self,
        weight: nn.Parameter,
        bias: nn.Parameter | None,
        output_sizes: list[int],
        binding: StepBinding,
    ) -> None:
        # Adopt the HF parameters instead of allocating (Linear.__init__ would).
        nn.Module.__init__(self)
        self.in_features = int(weight.shape[1])
        self.output_sizes = list(output_sizes)
        self.out_features = int(weight.shape[0])
        weight.requires_grad_(False)
        if bias is not None:
            bias.requires_grad_(False)
        self.weight = weight
        self.bias = bias
        self.packed_weight = None
        self.kernel_weight = None
        self.quant_parts = None
        self.step_binding = binding

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        return self.base_forward(x)


@dataclass(frozen=True, slots=True)
class ConvertedLinears:
    """What `convert_linears` did: module names (relative to the HF model), the parameter names whose
    checkpoint tensors are [in, out] (Conv1D) and load transposed, and the fused -> parts mapping."""

    names: tuple[str, ...]
    transposed: frozenset[str]
    packed_modules_mapping: dict[str, list[str]]


def convert_linears(hf_model: Any, binding: StepBinding) -> ConvertedLinears:
    """Replace the HF model's linear modules by `HFLinear`s sharing `binding`, in place."""
    from transformers.pytorch_utils import Conv1D

    output = hf_model.get_output_embeddings() if hasattr(hf_model, "get_output_embeddings") else None
    text = hf_model.config.get_text_config()
    names: list[str] = []
    transposed: set[str] = set()
    packed: dict[str, list[str]] = {}
    for name, module in list(hf_model.named_modules()):
        kind = type(module)
        if module is output or (kind is not nn.Linear and kind is not Conv1D) or _in_experts(name):
            continue
        leaf = name.rpartition(".")[2]
        if kind is Conv1D:
            weight = nn.Parameter(module.weight.detach().t().contiguous(), requires_grad=False)
            transposed.add(f"{name}.weight")
        else:
            weight = module.weight
        sizes = _fused_sizes(leaf, int(weight.shape[0]), text)
        if len(sizes) > 1:
            packed[leaf] = list(FUSED_MODULES[leaf])
        parent_name = name.rpartition(".")[0]
        parent = hf_model.get_submodule(parent_name) if parent_name else hf_model
        setattr(parent, leaf, HFLinear(weight, module.bias, sizes, binding))
        names.append(name)
    return ConvertedLinears(tuple(names), frozenset(transposed), packed)


def _in_experts(name: str) -> bool:
    return bool(_EXPERT_CONTAINERS & set(name.split(".")[:-1]))


def _fused_sizes(leaf: str, out_features: int, text: Any) -> list[int]:
    """The output slices of a fused module, or [out_features] when it is not one (or its shape says
    otherwise, e.g. an interleaved qkv)."""
    if leaf == "gate_up_proj" and out_features % 2 == 0:
        return [out_features // 2] * 2
    if leaf == "qkv_proj":
        heads = int(getattr(text, "num_attention_heads", 0) or 0)
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)
        head_dim = getattr(text, "head_dim", None) or (int(text.hidden_size) // heads if heads else 0)
        sizes = [heads * head_dim, kv_heads * head_dim, kv_heads * head_dim]
        if heads and sum(sizes) == out_features:
            return sizes
    return [out_features]
