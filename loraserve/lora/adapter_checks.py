"""Checking one adapter's tensors against the model and its config, module by module.

`group_keys` sorts PEFT keys (`base_model.model.<module>.lora_A[.<adapter>].weight`, `lora_B`, biases)
by module and refuses anything that is not a plain LoRA weight; `check_supported` refuses modules the
model cannot take LoRA on; `layer_weights` checks shapes against the model and the ranks in
adapter_config.json, and values: finite, within the LoRA dtype once scaled, and such that the products
the kernels form cannot overflow what follows them (`ValueCheck.term_ok`). Every refusal is a `LoRAAdapterError` naming
the adapter and the module.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

from loraserve.errors import LoRAAdapterError
from loraserve.layers.linear import Linear
from loraserve.lora.dora import dora_scale
from loraserve.lora.peft_helper import PEFTHelper
from loraserve.lora.targets import LoRATargets
from loraserve.lora.weights import LoRALayerWeights

_PREFIX = "base_model.model."
_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$"
)
_DORA_KEY = re.compile(r"^(?P<module>.+)\.lora_magnitude_vector(?:\.(?P<adapter>[^.]+))?(?:\.weight)?$")
_BASE_BIAS_KEY = re.compile(r"^(?P<module>.+?)(?:\.base_layer)?\.bias$")
_ROUNDING = 1.01  # a stored value may round up by 2^-8 of itself in bf16


@dataclass(slots=True)
class ModuleTensors:
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_b_bias: torch.Tensor | None = None
    base_bias: torch.Tensor | None = None
    magnitude: torch.Tensor | None = None  # DoRA's lora_magnitude_vector


def group_keys(
    tensors: dict[str, torch.Tensor], name: str, base_bias_allowed: bool
) -> dict[str, ModuleTensors]:
    """Group PEFT keys by module name; refuse keys that are not plain LoRA weights."""
    grouped: dict[str, ModuleTensors] = {}
    adapter_names: set[str] = set()
    unexpected: list[str] = []
    for key, tensor in tensors.items():
        stripped = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        if ".lora_embedding_" in stripped:
            raise LoRAAdapterError(f"LoRA adapter '{name}': LoRA on embeddings is not supported ({key})")
        dora = _DORA_KEY.match(stripped)
        if dora:
            if dora["adapter"]:
                adapter_names.add(dora["adapter"])
            grouped.setdefault(dora["module"], ModuleTensors()).magnitude = tensor
            continue
        match = _LORA_KEY.match(stripped)
        bias_match = _BASE_BIAS_KEY.match(stripped) if base_bias_allowed else None
        if match:
            if match["adapter"]:
                adapter_names.add(match["adapter"])
            parts = grouped.setdefault(match["module"], ModuleTensors())
            if match["kind"] == "lora_A" and match["param"] == "weight":
                parts.lora_a = tensor
            elif match["kind"] == "lora_B" and match["param"] == "weight":
                parts.lora_b = tensor
            elif match["kind"] == "lora_B":
                parts.lora_b_bias = tensor
            else:
                unexpected.append(key)
        elif bias_match:
            grouped.setdefault(bias_match["module"], ModuleTensors()).base_bias = tensor
        else:
            unexpected.append(key)
    if unexpected:
        raise LoRAAdapterError(
            f"LoRA adapter '{name}' has tensors that are not LoRA weights (unsupported modules_to_save, "
            f"embeddings or other extras): {sorted(unexpected)[:8]}"
        )
    if len(adapter_names) > 1:
        raise LoRAAdapterError(
            f"LoRA adapter '{name}' holds several adapters in one file: {sorted(adapter_names)}"
        )
    return grouped


def check_supported(by_module: dict[str, ModuleTensors], targets: LoRATargets, name: str) -> None:
    unsupported = sorted(
        m
        for m in by_module
        if m not in targets.modules and m not in targets.sub_modules and targets.expert_module(m) is None
    )
    if unsupported:
        leaves = sorted({m.rpartition(".")[2] for m in unsupported})
        raise LoRAAdapterError(
            f"LoRA adapter '{name}' targets modules this model cannot apply LoRA to: {leaves} "
            f"(e.g. {unsupported[0]}) on {targets.architecture or 'this model'}; supported target modules: "
            f"{targets.supported_leaf_names()}. "
            "Please verify that the loaded LoRA module is correct (made for this base model)."
        )


@dataclass(frozen=True)
class ValueCheck:
    """Values must be finite and stay below `limit` (the LoRA dtype's max) once scaled, and the LoRA
    term they form bounded (`term_ok`); `bound`, when known, is the largest |value| of the whole
    adapter, which settles most tensors without a pass."""

    bound: float | None
    limit: float

    def ok(self, tensor: torch.Tensor, factor: float) -> bool:
        factor = abs(factor)
        if self.bound is not None and self.bound * factor <= self.limit:
            return True
        if tensor.numel() == 0:
            return True
        low, high = torch.aminmax(tensor)  # one pass, NaN propagates
        largest = max(abs(float(low)), abs(float(high)))
        return math.isfinite(largest) and largest * factor <= self.limit

    def term_ok(self, lora_a: torch.Tensor, lora_b: torch.Tensor, scaling: float) -> bool:
        """Whether, for every input with |x| <= 1, the products the kernels form stay below
        sqrt(limit): past it the next layer's RMSNorm squares overflow and the model answers NaN
        (empty text), in fp32 and bf16 alike (1.8e19; 256 in fp16).

        The kernels form t = x @ A^T, then (t @ B^T) * scale (scale folded into B), summing in fp32:
        |t| <= ||A|| and every partial sum of the output <= ||A|| * ||B|| * |scale|, where ||M|| is
        the largest row sum of |M|; so |scale * B @ A| is bounded without forming it. Settled from the
        adapter's largest |value| alone when that suffices (the common case), else one pass over A
        and B."""
        if lora_a.numel() == 0 or lora_b.numel() == 0:
            return True
        (rank, in_features), scale = lora_a.shape, abs(scaling)
        if self.bound is not None:
            largest = self.bound * _ROUNDING
            if self._fits(in_features * largest, rank * largest, scale):
                return True
        return self._fits(_largest_row_sum(lora_a), _largest_row_sum(lora_b), scale)

    def _fits(self, a_norm: float, b_norm: float, scale: float) -> bool:
        ceiling = math.sqrt(self.limit)
        return a_norm <= ceiling and a_norm * b_norm * scale <= ceiling  # False for inf and NaN


def _largest_row_sum(tensor: torch.Tensor) -> float:
    return float(tensor.abs().sum(dim=1, dtype=torch.float64).max())


def layer_weights(
    module_name: str,
    parts: ModuleTensors,
    helper: PEFTHelper,
    base: Linear,
    out_start: int,
    out_end: int,
    name: str,
    values: ValueCheck,
) -> LoRALayerWeights:
    """Validate one module's tensors against the model and the config; scaling not yet folded in."""
    in_features, out_features = base.in_features, out_end - out_start
    if (parts.lora_a is None) != (parts.lora_b is None):
        missing = "lora_A" if parts.lora_a is None else "lora_B"
        raise LoRAAdapterError(f"LoRA adapter '{name}': {module_name} has no {missing} weight")
    rank = helper.rank_for(module_name) if parts.lora_a is not None else 0
    scaling = helper.scaling_for(module_name) if rank else 1.0
    lora_a = parts.lora_a if parts.lora_a is not None else torch.zeros(0, in_features)
    lora_b = parts.lora_b if parts.lora_b is not None else torch.zeros(out_features, 0)
    for label, tensor, expected, factor in (
        ("lora_A", lora_a, (rank, in_features), 1.0),
        ("lora_B", lora_b, (out_features, rank), scaling),
        ("lora_B bias", parts.lora_b_bias, (out_features,), scaling),
        ("bias", parts.base_bias, (out_features,), 1.0),
    ):
        if tensor is None:
            continue
        if tuple(tensor.shape) != expected:
            raise LoRAAdapterError(
                f"LoRA adapter '{name}' does not match this model (trained for another base model, or "
                f"rank differs from {helper.rank_for(module_name)} in adapter_config.json): {module_name} "
                f"{label} has shape {tuple(tensor.shape)}, expected {expected}. Please verify that the loaded "
                "LoRA module is correct"
            )
        if not tensor.is_floating_point() or not values.ok(tensor, factor):
            raise LoRAAdapterError(
                f"LoRA adapter '{name}': {module_name} {label} has non-finite or non-float values, or "
                f"values that overflow the LoRA dtype once scaled by {factor:g}"
            )
    if rank and not values.term_ok(lora_a, lora_b, scaling):
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {module_name} has weights whose LoRA term (scale {scaling:g} x lora_B "
            f"x lora_A) can exceed {math.sqrt(values.limit):g} for inputs within +-1, where the model's "
            "next normalisation overflows; lora_alpha or the weights are far too large"
        )
    bias = combined_bias(parts, scaling, base, out_start, out_end, module_name, name)
    weights = LoRALayerWeights(module_name, rank, lora_a, lora_b, scaling, bias)  # the caller sets the dtype
    if parts.magnitude is not None or (helper.use_dora and rank):
        weights.dora_scale = _dora_scale(parts, weights, base, out_start, out_end, helper, name)
    return weights


def _dora_scale(
    parts: ModuleTensors, weights: LoRALayerWeights, base: Linear, start: int, end: int, helper: PEFTHelper,
    name: str,
) -> torch.Tensor:
    """DoRA's g = m / ||W + s B A|| (`dora.py`), checked: a magnitude for every adapted module of a
    DoRA adapter, of the module's shape, and a finite g."""
    module_name = weights.module_name
    if not helper.use_dora or parts.magnitude is None or not weights.rank:
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {module_name} has "
            + ("a DoRA magnitude but use_dora is off" if not helper.use_dora else "no DoRA magnitude vector")
        )
    if tuple(parts.magnitude.shape) != (end - start,) or not parts.magnitude.is_floating_point():
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {module_name} DoRA magnitude has shape {tuple(parts.magnitude.shape)}, "
            f"expected ({end - start},)"
        )
    scale = dora_scale(base, start, end, weights.lora_a, weights.lora_b, weights.scaling, parts.magnitude)
    if not bool(torch.isfinite(scale).all()):
        raise LoRAAdapterError(
            f"LoRA adapter '{name}': {module_name} DoRA scale (magnitude / weight norm) is not finite"
        )
    return scale


def combined_bias(
    parts: ModuleTensors, scaling: float, base: Linear, start: int, end: int, module_name: str, name: str
) -> torch.Tensor | None:
    """PEFT's lora_B bias is scaled with B; a retrained base bias becomes its difference to the base."""
    bias: torch.Tensor | None = None
    if parts.lora_b_bias is not None:
        bias = parts.lora_b_bias.float() * scaling
    if parts.base_bias is not None:
        base_bias = base.bias
        if base_bias is None:
            raise LoRAAdapterError(
                f"LoRA adapter '{name}' has a bias for {module_name}, which has none in this model"
            )
        delta = parts.base_bias.float() - base_bias.detach()[start:end].float().cpu()
        bias = delta if bias is None else bias + delta
    return bias
