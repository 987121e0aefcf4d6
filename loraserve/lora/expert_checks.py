"""Checking an adapter's expert weights (PEFT's `target_parameters` on an MoE layer's stacked expert
tensors) and shaping them for the slots.

Older transformers' experts were nn.Linear modules, and adapters on them name one expert's module
(`<experts>.<e>.w1`/`w3`/`w2`, or `gate_proj`/`up_proj`/`down_proj`); those stack into the same form.
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
from loraserve.layers.fused_moe import DOWN, EXPERT_LEAVES, GATE_UP
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
    per_expert = {m: p for m, p in groups.items() if targets.expert_part(m) is not None}
    stacked = {m: p for m, p in groups.items() if m not in per_expert}
    for module, stages in _from_expert_modules(per_expert, targets, helper, name, values).items():
        out[module] = ExpertLoRAWeights(module, stages)
    for module_name, parts in sorted(stacked.items()):
        experts_name = targets.expert_module(module_name)
        assert experts_name is not None
        stage, lora_a, lora_b = _stage(module_name, experts_name, parts, targets, helper, name, values)
        weights = out.setdefault(experts_name, ExpertLoRAWeights(experts_name, {}))
        if stage in weights.stages:
            raise LoRAAdapterError(f"LoRA adapter '{name}' has two LoRA pairs for {experts_name}.{stage}")
        weights.stages[stage] = (lora_a, lora_b)
    for weights in out.values():
        weights.stages = {
            stage: (a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype))
            for stage, (a, b) in weights.stages.items()
        }
    return out


def _from_expert_modules(
    groups: dict[str, ModuleTensors], targets: LoRATargets, helper: PEFTHelper, name: str, values: ValueCheck
) -> dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]]:
    """Per-expert modules (`experts.N.w1/w3/w2` or `gate_proj/up_proj/down_proj`, as PEFT saved them
    on nn.Linear experts) stacked as the slots hold them: gate and up share one projection, so their
    pairs stack as PEFT's own conversion does, A = [A_gate; A_up] and B block-diagonal (rank r_gate +
    r_up); each B scaled by its module's scaling; experts without weights zero."""
    pairs: dict[str, dict[int, dict[int | None, tuple[torch.Tensor, torch.Tensor]]]] = {}
    for module_name, parts in sorted(groups.items()):
        part = targets.expert_part(module_name)
        assert part is not None
        experts_name, expert, leaf = part
        experts = targets.experts[experts_name]
        stage, block = EXPERT_LEAVES[leaf]
        fan_in, fan_out = (experts.hidden_size, experts.intermediate_size)[:: 1 if stage == GATE_UP else -1]
        lora_a, lora_b = _checked_pair(module_name, parts, fan_in, fan_out, targets, helper, name, values)
        per_stage = pairs.setdefault(f"{experts_name}|{stage}", {}).setdefault(expert, {})
        if block in per_stage:
            raise LoRAAdapterError(
                f"LoRA adapter '{name}' has two LoRA pairs for {experts_name}.{expert}.{leaf}"
            )
        per_stage[block] = (lora_a, lora_b * helper.scaling_for(module_name))
    out: dict[str, dict[str, tuple[torch.Tensor, torch.Tensor]]] = {}
    for key, by_expert in pairs.items():
        experts_name, stage = key.split("|")
        experts = targets.experts[experts_name]
        out.setdefault(experts_name, {})[stage] = _stack(
            experts.num_experts, experts.intermediate_size, by_expert
        )
    return out


def _stack(
    num_experts: int, size: int, by_expert: dict[int, dict[int | None, tuple[torch.Tensor, torch.Tensor]]]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A [E, rank, in], B [E, out, rank] from each expert's pairs by row block (0 gate, 1 up, None all)."""
    rank = max(sum(int(a.shape[0]) for a, _ in blocks.values()) for blocks in by_expert.values())
    first = next(iter(next(iter(by_expert.values())).values()))
    fan_in = int(first[0].shape[1])
    fan_out = 2 * size if None not in next(iter(by_expert.values())) else int(first[1].shape[0])
    lora_a = torch.zeros(num_experts, rank, fan_in)
    lora_b = torch.zeros(num_experts, fan_out, rank)
    for expert, blocks in by_expert.items():
        col = 0
        for block, (a, b) in sorted(blocks.items(), key=lambda item: -1 if item[0] is None else item[0]):
            rows = slice(0, fan_out) if block is None else slice(block * size, (block + 1) * size)
            lora_a[expert, col : col + a.shape[0]] = a.float()
            lora_b[expert, rows, col : col + a.shape[0]] = b.float()
            col += int(a.shape[0])
    return lora_a, lora_b


def _checked_pair(
    module_name: str,
    parts: ModuleTensors,
    fan_in: int,
    fan_out: int,
    targets: LoRATargets,
    helper: PEFTHelper,
    name: str,
    values: ValueCheck,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One expert module's (A [r, in], B [out, r]), checked as a Linear's pair is."""
    where = f"{module_name} on {targets.architecture}"
    if parts.lora_a is None or parts.lora_b is None:
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {where} has no {'lora_A' if parts.lora_a is None else 'lora_B'}"
        )
    if parts.lora_b_bias is not None or parts.base_bias is not None:
        raise LoRAAdapterError(f"LoRA adapter '{name}': {where} has a bias, which expert LoRA does not take")
    rank, scaling = helper.rank_for(module_name), helper.scaling_for(module_name)
    expected = ((rank, fan_in), (fan_out, rank))
    found = (tuple(parts.lora_a.shape), tuple(parts.lora_b.shape))
    if found != expected:
        raise LoRAAdapterError(
            f"LoRA adapter '{name}' does not match this model (trained for another base model, or rank "
            f"differs from {rank} in adapter_config.json): {where} has lora_A {found[0]} and lora_B "
            f"{found[1]}, expected {expected[0]} and {expected[1]}"
        )
    if not parts.lora_a.is_floating_point() or not (
        values.ok(parts.lora_a, 1.0) and values.ok(parts.lora_b, scaling)
    ):
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {where} has non-finite or non-float values, or values that overflow "
            f"the LoRA dtype once scaled by {scaling:g}"
        )
    if not values.term_ok(parts.lora_a, parts.lora_b, scaling):
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {where} has weights whose LoRA term (scale {scaling:g} x lora_B x "
            f"lora_A) can exceed {math.sqrt(values.limit):g} for inputs within +-1, where the model's next "
            "normalisation overflows; lora_alpha or the weights are far too large"
        )
    return parts.lora_a, parts.lora_b


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
