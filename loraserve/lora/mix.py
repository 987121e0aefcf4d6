"""Linear mixes of adapters, materialised as one virtual adapter by concatenating ranks.

A mix of adapters i with weights w_i computes sum_i w_i * s_i * B_i A_i x (s_i each adapter's own
alpha / r scaling). That is exactly one LoRA of rank sum_i r_i: A = [A_1; A_2; ...] stacked along the
rank, B = [w_1 s_1 B_1, w_2 s_2 B_2, ...] side by side (PEFT's `add_weighted_adapter(combination_type=
"cat")` builds the same product; it puts w_i s_i on A instead). So a mix takes a slot like any adapter
and batches with single adapters through the same kernels. A module that a component does not adapt
contributes no rank there (MoE expert weights concatenate the same way, per expert); a bias is the weighted sum of the components' biases.

Limits: at most `MAX_MIX_ADAPTERS` components, distinct, none a mix itself; weights finite within
+-`MAX_LORA_SCALE`; at every module the summed rank must fit the slots (`--max-lora-rank`), else a
`LoRAAdapterError` naming the module and the limit. The mix's identity digest is sha256 over its
components' content digests and weights: the prefix cache keys a mix by what it computes.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence

import torch

from loraserve.errors import LoRAAdapterError
from loraserve.lora.digest import PendingDigest
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.request import LoRARequest
from loraserve.lora.weights import (
    ExpertLoRAWeights,
    LoRALayerWeights,
    ModuleLoRA,
    PackedLoRALayerWeights,
    VocabLoRAWeights,
)

MIX_LABEL = "(mix)"  # every mix's name in metrics and residency lists: a mix's name holds client weights


def mix_adapters(request: LoRARequest, parts: Sequence[tuple[LoRAModel, float]], max_rank: int) -> LoRAModel:
    """The virtual adapter of `request` (a mix: `request.mix`) from its components' loaded adapters,
    in `request.mix` order, each with its weight."""
    dora = [model.name for model, _ in parts if model.uses_dora]
    if dora:
        raise LoRAAdapterError(
            f"LoRA mix '{request.lora_name}': {dora[0]!r} is a DoRA adapter, and DoRA adapters cannot be mixed "
            "(their output scale is not linear in the weights)."
        )
    replacing = [model.name for model, _ in parts if model.replaces_rows]
    if replacing:
        raise LoRAAdapterError(
            f"LoRA mix '{request.lora_name}': {replacing[0]!r} replaces vocab weights (trainable tokens or "
            "modules_to_save), which cannot be mixed (a replaced row is no sum of terms)."
        )
    names = sorted({name for model, _ in parts for name in model.loras})
    loras: dict[str, ModuleLoRA] = {}
    for name in names:
        modules = [(model.loras.get(name), weight) for model, weight in parts]
        loras[name] = _mix_module(request.lora_name, name, modules, max_rank)
    return LoRAModel(
        lora_id=request.lora_id,
        name=request.lora_name,
        path=request.lora_path,
        rank=max((w.rank for w in loras.values()), default=0),
        loras=loras,
        pending_digest=mix_digest(parts),
        num_bytes=sum(w.num_bytes for w in loras.values()),
    )


def mix_digest(parts: Sequence[tuple[LoRAModel, float]]) -> PendingDigest:
    """sha256 over ("mix", each component's content digest and weight, in order)."""
    identity = [[model.pending_digest.result(), repr(float(weight))] for model, weight in parts]
    return PendingDigest(hashlib.sha256(json.dumps(["mix", identity]).encode()), [])


def _mix_module(
    adapter: str, module: str, parts: list[tuple[ModuleLoRA | None, float]], max_rank: int
) -> ModuleLoRA:
    vocab = [(p.lora, w) for p, w in parts if isinstance(p, VocabLoRAWeights) and p.lora is not None]
    if any(isinstance(p, VocabLoRAWeights) for p, _ in parts):  # an embedding's A [r, vocab] stacks the same
        return VocabLoRAWeights(module, lora=_concat(adapter, module, vocab, max_rank) if vocab else None)
    experts = [(p, w) for p, w in parts if isinstance(p, ExpertLoRAWeights)]
    if experts:
        return _concat_experts(adapter, module, experts, max_rank)
    packed = [p for p, _ in parts if isinstance(p, PackedLoRALayerWeights)]
    if not packed:
        plain = [(p, w) for p, w in parts if isinstance(p, LoRALayerWeights)]
        return _concat(adapter, module, plain, max_rank)
    num_slices = len(packed[0].slices)
    slices: list[LoRALayerWeights | None] = []
    for q in range(num_slices):
        chosen = [(p.slices[q], w) for p, w in parts if isinstance(p, PackedLoRALayerWeights)]
        present = [(s, w) for s, w in chosen if s is not None]
        slices.append(_concat(adapter, module, present, max_rank) if present else None)
    return PackedLoRALayerWeights(module, slices)


def _concat(
    adapter: str, module: str, parts: list[tuple[LoRALayerWeights, float]], max_rank: int
) -> LoRALayerWeights:
    """One module's (or slice's) components side by side along the rank, their factors on B (in
    float32, rounded once to the weights' dtype), the mix's own scaling 1."""
    rank = sum(p.rank for p, _ in parts)
    if rank > max_rank:
        ranks = " + ".join(str(p.rank) for p, _ in parts)
        raise LoRAAdapterError(
            f"LoRA mix '{adapter}': its total rank at {module} is {rank} ({ranks}), above --max-lora-rank="
            f"{max_rank}; mix fewer or smaller adapters, or raise --max-lora-rank."
        )
    first = parts[0][0]
    dtype = first.lora_b.dtype
    lora_a = torch.cat([p.lora_a for p, _ in parts], dim=0)
    lora_b = torch.cat([p.lora_b.float() * (w * p.scaling) for p, w in parts], dim=1).to(dtype)
    biases = [(p.bias, w) for p, w in parts if p.bias is not None]
    bias = None
    if biases:
        bias = sum((b.float() * w for b, w in biases), torch.zeros_like(biases[0][0], dtype=torch.float32))
        bias = bias.to(biases[0][0].dtype)
    return LoRALayerWeights(first.module_name, rank, lora_a, lora_b, 1.0, bias)


def _concat_experts(
    adapter: str, module: str, parts: list[tuple[ExpertLoRAWeights, float]], max_rank: int
) -> ExpertLoRAWeights:
    """An MoE layer's expert adapters side by side along the rank, per stacked parameter: A [E, r, in]
    stacked on dim 1, B [E, out, r] (its scaling already folded in) times the weight, on dim 2."""
    stages: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    for stage in sorted({stage for p, _ in parts for stage in p.stages}):
        present = [(p.stages[stage], w) for p, w in parts if stage in p.stages]
        rank = sum(int(a.shape[1]) for (a, _), _ in present)
        if rank > max_rank:
            raise LoRAAdapterError(
                f"LoRA mix '{adapter}': its total rank at {module}.{stage} is {rank}, above --max-lora-rank="
                f"{max_rank}; mix fewer or smaller adapters, or raise --max-lora-rank."
            )
        lora_a = torch.cat([a for (a, _), _ in present], dim=1)
        dtype = present[0][0][1].dtype
        lora_b = torch.cat([b.float() * w for (_, b), w in present], dim=2).to(dtype)
        stages[stage] = (lora_a, lora_b)
    return ExpertLoRAWeights(parts[0][0].module_name, stages)
