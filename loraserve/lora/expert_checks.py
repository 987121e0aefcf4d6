"""Checking an adapter's expert weights (PEFT's `target_parameters` on an MoE layer's stacked expert
tensors) and shaping them for the slots.

PEFT (0.17+) wraps each targeted 3-D parameter [E, out, in] in a `ParamWrapper` whose lora_A is
[rank * E, in] (expert e's A in rows e * rank ...) and lora_B [out, rank * E] (expert e's B in columns
j * E + e); two targeted tensors of one module nest, the inner wrapper's keys under `.base_layer`, in
an order PEFT does not fix. Which tensor a pair adapts is read from its shapes: gate_up_proj takes
in=H and gives out=2I, down_proj in=I and out=H (never both, as 2I != I); ranks and alphas are
PEFT's for `<experts>.<tensor>` (PEFT's conversion of gate_proj + up_proj targets onto the fused
tensor writes rank_pattern / alpha_pattern entries for `gate_up_proj` at twice r). Every refusal is a
`LoRAAdapterError` naming the adapter, the module and the architecture.
"""

from __future__ import annotations

import math

import torch

from loraserve.errors import LoRAAdapterError
from loraserve.layers.fused_moe import DOWN, GATE_UP
from loraserve.lora.adapter_checks import ModuleTensors, ValueCheck
from loraserve.lora.peft_helper import PEFTHelper
from loraserve.lora.targets import LoRATargets
from loraserve.lora.weights import ExpertLoRAWeights


def expert_weights(
    groups: dict[str, ModuleTensors],
    targets: LoRATargets,
    helper: PEFTHelper,
    name: str,
    values: ValueCheck,
    dtype: torch.dtype,
    device: torch.device | str,
) -> dict[str, ExpertLoRAWeights]:
    """The expert weights of an adapter by experts module name; `groups` holds only the adapter's
    modules that `targets.expert_module` names."""
    out: dict[str, ExpertLoRAWeights] = {}
    for module_name, parts in sorted(groups.items()):
        experts_name = targets.expert_module(module_name)
        assert experts_name is not None
        stage, lora_a, lora_b = _stage(module_name, experts_name, parts, targets, helper, name, values)
        weights = out.setdefault(experts_name, ExpertLoRAWeights(experts_name, {}))
        if stage in weights.stages:
            raise LoRAAdapterError(f"LoRA adapter '{name}' has two LoRA pairs for {experts_name}.{stage}")
        weights.stages[stage] = (lora_a.to(device=device, dtype=dtype), lora_b.to(device=device, dtype=dtype))
    return out


def _stage(
    module_name: str,
    experts_name: str,
    parts: ModuleTensors,
    targets: LoRATargets,
    helper: PEFTHelper,
    name: str,
    values: ValueCheck,
) -> tuple[str, torch.Tensor, torch.Tensor]:
    """(stacked parameter, A [E, r, in], B [E, out, r] * scaling) of one PEFT ParamWrapper."""
    experts = targets.experts[experts_name]
    where = f"{module_name} on {targets.architecture}"
    if parts.lora_a is None or parts.lora_b is None:
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {where} has no {'lora_A' if parts.lora_a is None else 'lora_B'}"
        )
    if parts.lora_b_bias is not None or parts.base_bias is not None:
        raise LoRAAdapterError(f"LoRA adapter '{name}': {where} has a bias, which expert LoRA does not take")
    num, hidden, size = experts.num_experts, experts.hidden_size, experts.intermediate_size
    ranks = {stage: helper.rank_for(f"{experts_name}.{stage}") for stage in (GATE_UP, DOWN)}
    fan = {GATE_UP: (hidden, 2 * size), DOWN: (size, hidden)}
    shapes = {s: ((ranks[s] * num, fan[s][0]), (fan[s][1], ranks[s] * num)) for s in (GATE_UP, DOWN)}
    found = (tuple(parts.lora_a.shape), tuple(parts.lora_b.shape))
    stage = next((s for s, expected in shapes.items() if found == expected), None)
    if stage is None:
        raise LoRAAdapterError(
            f"LoRA adapter '{name}' does not match this model (trained for another base model, or ranks "
            f"differ from adapter_config.json's): {where} has lora_A {found[0]} and lora_B {found[1]}, "
            f"expected {shapes[GATE_UP]} (gate_up_proj) or {shapes[DOWN]} (down_proj) for {num} experts"
        )
    rank, scaling = ranks[stage], helper.scaling_for(f"{experts_name}.{stage}")
    lora_a = parts.lora_a.reshape(num, rank, -1)
    lora_b = parts.lora_b.reshape(-1, rank, num).permute(2, 0, 1)
    if not (values.ok(lora_a, 1.0) and values.ok(lora_b, scaling)) or not parts.lora_a.is_floating_point():
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {where} has non-finite or non-float values, or values that overflow "
            f"the LoRA dtype once scaled by {scaling:g}"
        )
    if not all(values.term_ok(lora_a[e], lora_b[e], scaling) for e in range(num)):
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {where} has weights whose LoRA term (scale {scaling:g} x lora_B x "
            f"lora_A) can exceed {math.sqrt(values.limit):g} for inputs within +-1, where the model's next "
            "normalisation overflows; lora_alpha or the weights are far too large"
        )
    return stage, lora_a.contiguous(), (lora_b.float() * scaling).contiguous()
