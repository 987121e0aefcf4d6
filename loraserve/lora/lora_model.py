"""`LoRAModel`: one adapter read from disk, validated against the base model, ready for slot upload.

Everything is checked here, before the adapter is registered anywhere: the weights file
(`adapter_model.safetensors`, else `.bin` / `.pt` through `torch.load(weights_only=True)`), every key
(PEFT names `base_model.model.<module>.lora_A[.<adapter>].weight`, `.lora_B...`), that each module
can take LoRA in this model, every shape, ranks against adapter_config.json, and finiteness.
Sub-module weights (q_proj, k_proj, v_proj) are packed into the model's packed modules (qkv_proj).
"""

from __future__ import annotations

import contextlib
import logging
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn

from loraserve.errors import LoRAAdapterError
from loraserve.layers.linear import Linear
from loraserve.lora.checkpoint import AdapterFile, PendingDigest, read_adapter_file
from loraserve.lora.layers import LoRATargets
from loraserve.lora.peft_helper import PEFTHelper
from loraserve.lora.request import LoRARequest
from loraserve.lora.weights import LoRALayerWeights, ModuleLoRA, PackedLoRALayerWeights

logger = logging.getLogger(__name__)

_PREFIX = "base_model.model."
_LORA_KEY = re.compile(
    r"^(?P<module>.+)\.(?P<kind>lora_A|lora_B)(?:\.(?P<adapter>[^.]+))?\.(?P<param>weight|bias)$"
)
_BASE_BIAS_KEY = re.compile(r"^(?P<module>.+?)(?:\.base_layer)?\.bias$")


@dataclass(frozen=True)
class AdapterIdentity:
    """Content identity of an adapter: same name with new weights gives a new digest."""

    name: str
    digest: str


@dataclass(slots=True)
class _ModuleTensors:
    lora_a: torch.Tensor | None = None
    lora_b: torch.Tensor | None = None
    lora_b_bias: torch.Tensor | None = None
    base_bias: torch.Tensor | None = None


@dataclass(slots=True)
class LoRAModel:
    """A loaded adapter: per-module weights keyed by the model's (packed) module names."""

    lora_int_id: int
    name: str
    path: str
    rank: int
    loras: dict[str, ModuleLoRA]
    pending_digest: PendingDigest
    num_bytes: int = field(default=0)

    @property
    def identity(self) -> AdapterIdentity:
        """Name + content digest (waits for the digest if it is still being hashed)."""
        return AdapterIdentity(self.name, self.pending_digest.result())

    @property
    def id(self) -> int:
        return self.lora_int_id

    def get_lora(self, module_name: str) -> ModuleLoRA | None:
        return self.loras.get(module_name)

    @classmethod
    def from_local_checkpoint(
        cls,
        lora_dir: str | Path,
        lora_request: LoRARequest,
        peft_helper: PEFTHelper,
        model: nn.Module,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
    ) -> LoRAModel:
        adapter = read_adapter_file(Path(lora_dir), lora_request.lora_name)
        return cls.from_tensors(adapter, lora_request, peft_helper, model, dtype, device, str(lora_dir))

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, torch.Tensor] | AdapterFile,
        lora_request: LoRARequest,
        peft_helper: PEFTHelper,
        model: nn.Module,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        path: str = "",
    ) -> LoRAModel:
        """An adapter from its tensors (a dict, or a file read by `read_adapter_file`)."""
        adapter = tensors if isinstance(tensors, AdapterFile) else AdapterFile(
            lora_request.lora_name, Path(path or lora_request.lora_path), tensors
        )
        name = lora_request.lora_name
        # The identity digest is hashed on background threads (hashlib releases the GIL) while the
        # weights are parsed here and, often, uploaded to a slot; `identity` waits for it.
        pending = adapter.start_digest(peft_helper.config_json)
        try:
            bound = adapter.max_abs()
            loras, num_bytes = _build_loras(adapter.tensors, name, peft_helper, model, dtype, device, bound)
        except BaseException:
            with contextlib.suppress(Exception):
                pending.result()  # never leave hashing threads behind a failed load
            raise
        return cls(
            lora_int_id=lora_request.lora_int_id,
            name=name,
            path=path or lora_request.lora_path,
            rank=max(w.rank for w in loras.values()),
            loras=loras,
            pending_digest=pending,
            num_bytes=num_bytes,
        )


def _build_loras(
    tensors: dict[str, torch.Tensor],
    name: str,
    peft_helper: PEFTHelper,
    model: nn.Module,
    dtype: torch.dtype,
    device: torch.device | str,
    bound: float | None = None,
) -> tuple[dict[str, ModuleLoRA], int]:
    """Validated per-module weights (packed where the model packs) and their byte count. The scaling
    stays beside B: slots fold it in as they copy B (`LinearWithLoRA.set_lora`), saving a pass here.
    `bound`: the largest |value| of all tensors when the caller has found it in one pass (else each
    tensor is checked on its own)."""
    targets = LoRATargets.from_model(model)
    by_module = _group_keys(tensors, name, peft_helper.bias != "none")
    if not by_module:
        raise LoRAAdapterError(f"LoRA adapter '{name}' has no LoRA weights")
    _check_supported(by_module, targets, name)
    untargeted = sorted(
        m for m, p in by_module.items() if p.lora_a is not None and not peft_helper.targets_module(m)
    )
    if untargeted:
        logger.warning(
            "LoRA adapter '%s' has weights for modules its config does not target: %s", name, untargeted
        )
    loras: dict[str, ModuleLoRA] = {}
    packed: dict[str, list[LoRALayerWeights | None]] = {}
    for module_name, parts in sorted(by_module.items()):
        base, packed_name, index = _locate(module_name, targets)
        offsets = base.slice_offsets() if packed_name else [0, base.out_features]
        weights = _layer_weights(
            module_name, parts, peft_helper, base, offsets[index], offsets[index + 1], name,
            _ValueCheck(bound, torch.finfo(dtype).max if dtype.is_floating_point else math.inf),
        )
        if weights.bias is not None and not peft_helper.bias_enabled:
            raise LoRAAdapterError(
                f"LoRA adapter '{name}': {module_name} has a bias; Adapter bias cannot be used without "
                "--enable-lora-bias"
            )
        weights = _to(weights, dtype, device)
        if packed_name is None:
            loras[module_name] = weights
        else:
            packed.setdefault(packed_name, [None] * len(base.output_sizes))[index] = weights
    for packed_name, slices in packed.items():
        if packed_name in loras:
            raise LoRAAdapterError(
                f"LoRA adapter '{name}' has weights for {packed_name} and for its sub-modules"
            )
        loras[packed_name] = PackedLoRALayerWeights(packed_name, slices)
    return loras, sum(w.num_bytes for w in loras.values())


def _locate(module_name: str, targets: LoRATargets) -> tuple[Linear, str | None, int]:
    """(model layer, packed module name or None, output slice index) for an adapter module name."""
    if module_name in targets.modules:
        return targets.modules[module_name], None, 0
    packed_name, index = targets.sub_modules[module_name]
    return targets.modules[packed_name], packed_name, index


def _to(weights: LoRALayerWeights, dtype: torch.dtype, device: torch.device | str) -> LoRALayerWeights:
    weights.lora_a = weights.lora_a.to(device=device, dtype=dtype)
    weights.lora_b = weights.lora_b.to(device=device, dtype=dtype)
    if weights.bias is not None:
        weights.bias = weights.bias.to(device=device, dtype=dtype)
    return weights


def _group_keys(
    tensors: dict[str, torch.Tensor], name: str, base_bias_allowed: bool
) -> dict[str, _ModuleTensors]:
    """Group PEFT keys by module name; refuse keys that are not plain LoRA weights."""
    grouped: dict[str, _ModuleTensors] = {}
    adapter_names: set[str] = set()
    unexpected: list[str] = []
    for key, tensor in tensors.items():
        stripped = key[len(_PREFIX) :] if key.startswith(_PREFIX) else key
        if ".lora_embedding_" in stripped:
            raise LoRAAdapterError(f"LoRA adapter '{name}': LoRA on embeddings is not supported ({key})")
        if ".lora_magnitude_vector" in stripped:
            raise LoRAAdapterError(f"LoRA adapter '{name}': DoRA is not supported ({key})")
        match = _LORA_KEY.match(stripped)
        bias_match = _BASE_BIAS_KEY.match(stripped) if base_bias_allowed else None
        if match:
            if match["adapter"]:
                adapter_names.add(match["adapter"])
            parts = grouped.setdefault(match["module"], _ModuleTensors())
            if match["kind"] == "lora_A" and match["param"] == "weight":
                parts.lora_a = tensor
            elif match["kind"] == "lora_B" and match["param"] == "weight":
                parts.lora_b = tensor
            elif match["kind"] == "lora_B":
                parts.lora_b_bias = tensor
            else:
                unexpected.append(key)
        elif bias_match:
            grouped.setdefault(bias_match["module"], _ModuleTensors()).base_bias = tensor
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


def _check_supported(by_module: dict[str, _ModuleTensors], targets: LoRATargets, name: str) -> None:
    unsupported = sorted(m for m in by_module if m not in targets.modules and m not in targets.sub_modules)
    if unsupported:
        leaves = sorted({m.rpartition(".")[2] for m in unsupported})
        raise LoRAAdapterError(
            f"LoRA adapter '{name}' targets modules this model cannot apply LoRA to: {leaves} "
            f"(e.g. {unsupported[0]}); supported target modules: {targets.supported_leaf_names()}"
        )


@dataclass(frozen=True)
class _ValueCheck:
    """Values must be finite and stay below `limit` (the LoRA dtype's max) once scaled; `bound`, when
    known, is the largest |value| of the whole adapter, which settles most tensors without a pass."""

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


def _layer_weights(
    module_name: str,
    parts: _ModuleTensors,
    helper: PEFTHelper,
    base: Linear,
    out_start: int,
    out_end: int,
    name: str,
    values: _ValueCheck,
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
                f"{label} has shape {tuple(tensor.shape)}, expected {expected}"
            )
        if not tensor.is_floating_point() or not values.ok(tensor, factor):
            raise LoRAAdapterError(
                f"LoRA adapter '{name}': {module_name} {label} has non-finite or non-float values, or "
                f"values that overflow the LoRA dtype once scaled by {factor:g}"
            )
    bias = _combined_bias(parts, scaling, base, out_start, out_end, module_name, name)
    return LoRALayerWeights(module_name, rank, lora_a.float(), lora_b.float(), scaling, bias)


def _combined_bias(
    parts: _ModuleTensors, scaling: float, base: Linear, start: int, end: int, module_name: str, name: str
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
