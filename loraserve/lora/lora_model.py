"""`LoRAModel`: one adapter read from disk, validated against the base model, ready for slot upload.

Everything is checked before the adapter is registered anywhere: the weights file (`checkpoint.py`),
then every key, module, shape, rank and value (`adapter_checks.py`; an MoE layer's expert tensors:
`expert_checks.py`). Sub-module weights (q_proj,
k_proj, v_proj) are packed into the model's packed modules (qkv_proj). The model is seen only through
its `LoRATargets`, built once per model; `adapter_read.read_adapter` is the whole read in order.
"""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

from loraserve.errors import LoRAAdapterError
from loraserve.lora.adapter_checks import (
    ModuleTensors,
    ValueCheck,
    check_supported,
    group_keys,
    layer_weights,
)
from loraserve.lora.checkpoint import AdapterFile, read_adapter_file
from loraserve.lora.digest import PendingDigest
from loraserve.lora.expert_checks import expert_weights
from loraserve.lora.peft_helper import PEFTHelper
from loraserve.lora.request import LoRARequest
from loraserve.lora.targets import LoRATargets
from loraserve.lora.vocab_checks import split_vocab_tensors, vocab_weights
from loraserve.lora.weights import (
    ExpertLoRAWeights,
    LoRALayerWeights,
    ModuleLoRA,
    PackedLoRALayerWeights,
    VocabLoRAWeights,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AdapterIdentity:
    """Content identity of an adapter: same name with new weights gives a new digest."""

    name: str
    digest: str


@dataclass(slots=True)
class LoRAModel:
    """A loaded adapter: per-module weights keyed by the model's (packed) module names."""

    lora_id: int
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
    def uses_dora(self) -> bool:
        """Whether any module carries a DoRA scale (PEFT's use_dora)."""
        for lora in self.loras.values():
            if isinstance(lora, ExpertLoRAWeights | VocabLoRAWeights):  # PEFT has no DoRA on these
                continue
            parts = lora.slices if isinstance(lora, PackedLoRALayerWeights) else [lora]
            if any(p is not None and p.dora_scale is not None for p in parts):
                return True
        return False

    @property
    def replaces_rows(self) -> bool:
        """Whether it replaces vocab weights (trainable tokens, modules_to_save): no scale or mix applies."""
        return any(isinstance(w, VocabLoRAWeights) and w.replaces_rows for w in self.loras.values())

    def get_lora(self, module_name: str) -> ModuleLoRA | None:
        return self.loras.get(module_name)

    @classmethod
    def from_local_checkpoint(
        cls,
        lora_dir: str | Path,
        lora_request: LoRARequest,
        peft_helper: PEFTHelper,
        targets: LoRATargets,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        max_file_bytes: int | None = None,
    ) -> LoRAModel:
        """The adapter in folder `lora_dir`; a weights file over `max_file_bytes` is refused unread."""
        adapter = read_adapter_file(Path(lora_dir), lora_request.lora_name, max_file_bytes)
        return cls.from_tensors(adapter, lora_request, peft_helper, targets, dtype, device, str(lora_dir))

    @classmethod
    def from_tensors(
        cls,
        tensors: dict[str, torch.Tensor] | AdapterFile,
        lora_request: LoRARequest,
        peft_helper: PEFTHelper,
        targets: LoRATargets,
        dtype: torch.dtype,
        device: torch.device | str = "cpu",
        path: str = "",
    ) -> LoRAModel:
        """An adapter from its tensors (a dict, or a file read by `read_adapter_file`), checked and
        shaped for `targets` (`LoRATargets.from_model(model)`)."""
        adapter = tensors if isinstance(tensors, AdapterFile) else AdapterFile(
            lora_request.lora_name, Path(path or lora_request.lora_path), tensors
        )
        name = lora_request.lora_name
        # The identity digest is hashed on background threads (hashlib releases the GIL) while the
        # weights are parsed here and, often, uploaded to a slot; `identity` waits for it.
        pending = adapter.start_digest(peft_helper.config_json)
        try:
            bound = adapter.max_abs()  # of the stored values: the check below is against the target dtype
            tensors = adapter.tensors_in(dtype)
            loras, num_bytes = _build_loras(tensors, name, peft_helper, targets, dtype, device, bound)
        except BaseException:
            with contextlib.suppress(Exception):
                pending.result()  # never leave hashing threads behind a failed load
            raise
        return cls(
            lora_id=lora_request.lora_id,
            name=name,
            path=path or lora_request.lora_path,
            rank=max((w.rank for w in loras.values()), default=0),
            loras=loras,
            pending_digest=pending,
            num_bytes=num_bytes,
        )


def _build_loras(
    tensors: dict[str, torch.Tensor],
    name: str,
    peft_helper: PEFTHelper,
    targets: LoRATargets,
    dtype: torch.dtype,
    device: torch.device | str,
    bound: float | None = None,
) -> tuple[dict[str, ModuleLoRA], int]:
    """Validated per-module weights (packed where the model packs) and their byte count. The scaling
    stays beside B: slots fold it in as they copy B (`LoRABuffers.write`), saving a pass here.
    `bound`: the largest |value| of all tensors when the caller has found it in one pass (else each
    tensor is checked on its own)."""
    tensors, vocab_groups = split_vocab_tensors(tensors, targets, name)
    by_module, original = _model_names(group_keys(tensors, name, peft_helper.bias != "none"), targets, name)
    if not by_module and not vocab_groups:
        raise LoRAAdapterError(f"LoRA adapter '{name}' has no LoRA weights")
    check_supported(by_module, targets, name)
    value_check = ValueCheck(bound, torch.finfo(dtype).max if dtype.is_floating_point else math.inf)
    expert_groups = {m: by_module.pop(m) for m in list(by_module) if targets.expert_module(m) is not None}
    loras: dict[str, ModuleLoRA] = {}
    for experts_name, experts in expert_weights(
        expert_groups, targets, peft_helper, name, value_check, dtype, device
    ).items():
        if targets.takes_lora(experts_name):
            loras[experts_name] = experts
    untargeted = sorted(  # expert tensors are targeted by target_parameters, not by module
        original[m]
        for m, p in by_module.items()
        if p.lora_a is not None and not peft_helper.targets_module(original[m])
    )
    if untargeted:
        logger.warning(
            "LoRA adapter '%s' has weights for modules its config does not target: %s", name, untargeted
        )
    packed: dict[str, list[LoRALayerWeights | None]] = {}
    skipped = []
    for vocab_name, vocab in vocab_weights(vocab_groups, targets, peft_helper, name, value_check).items():
        if targets.takes_lora(vocab_name):
            loras[vocab_name] = _vocab_to(vocab, dtype, device)
        else:
            skipped.append(vocab_name.rpartition(".")[2])
    for module_name, parts in sorted(by_module.items()):
        base, packed_name, index = targets.locate(module_name)
        if not targets.takes_lora(packed_name or module_name):  # --lora-target-modules left it out
            skipped.append(module_name.rpartition(".")[2])
            continue
        offsets = base.slice_offsets() if packed_name else [0, base.out_features]
        weights = layer_weights(  # PEFT's rank and alpha patterns match the names it saved
            original[module_name], parts, peft_helper, base, offsets[index], offsets[index + 1], name,
            value_check,
        )
        if weights.bias is not None and not peft_helper.bias_enabled:
            raise LoRAAdapterError(
                f"LoRA adapter '{name}': {module_name} has a bias; Adapter bias cannot be used without "
                "bias_enabled (start with --enable-lora-bias)"
            )
        weights = _to(weights, dtype, device)
        if packed_name is None:
            loras[module_name] = weights
        else:
            packed.setdefault(packed_name, [None] * len(base.output_sizes))[index] = weights
    if skipped:
        logger.warning(
            "LoRA adapter '%s': weights for %s are not applied (--lora-target-modules leaves them out)",
            name, sorted(set(skipped)),
        )
    for packed_name, slices in packed.items():
        if packed_name in loras:
            raise LoRAAdapterError(
                f"LoRA adapter '{name}' has weights for {packed_name} and for its sub-modules"
            )
        loras[packed_name] = PackedLoRALayerWeights(packed_name, slices)
    return loras, sum(w.num_bytes for w in loras.values())


def _model_names(
    by_module: dict[str, ModuleTensors], targets: LoRATargets, name: str
) -> tuple[dict[str, ModuleTensors], dict[str, str]]:
    """The adapter's modules under the model's names, and each one's name as the adapter saved it.
    A vision-language model's tower and connector modules are skipped, with a warning, unless they take
    LoRA here (--enable-tower-connector-lora): vLLM's rule for them."""
    renamed: dict[str, ModuleTensors] = {}
    original: dict[str, str] = {}
    skipped: list[str] = []
    for module, parts in by_module.items():
        model_name = targets.model_name(module)
        if targets.in_tower(model_name) and not targets.tower_lora:
            skipped.append(module)
            continue
        if model_name in renamed:
            raise LoRAAdapterError(f"LoRA adapter '{name}' has weights for {model_name} under two names")
        renamed[model_name], original[model_name] = parts, module
    if skipped:
        logger.warning(
            "LoRA adapter '%s': its %d vision tower / connector modules (e.g. %s) are not applied: only the "
            "language model takes LoRA unless the server runs with --enable-tower-connector-lora",
            name, len(skipped), sorted(skipped)[0],
        )
    return renamed, original


def _vocab_to(weights: VocabLoRAWeights, dtype: torch.dtype, device: torch.device | str) -> VocabLoRAWeights:
    if weights.lora is not None:
        weights.lora = _to(weights.lora, dtype, device)
    if weights.token_ids is not None and weights.token_rows is not None:
        weights.token_ids = weights.token_ids.to(device)
        weights.token_rows = weights.token_rows.to(device=device, dtype=dtype)
    if weights.full is not None:
        weights.full = weights.full.to(device=device, dtype=dtype)
    return weights


def _to(weights: LoRALayerWeights, dtype: torch.dtype, device: torch.device | str) -> LoRALayerWeights:
    if weights.lora_a.dtype != dtype or weights.lora_a.device != torch.device(device):
        weights.lora_a = weights.lora_a.to(device=device, dtype=dtype)
    if weights.lora_b.dtype != dtype or weights.lora_b.device != torch.device(device):
        weights.lora_b = weights.lora_b.to(device=device, dtype=dtype)
    if weights.bias is not None:
        weights.bias = weights.bias.to(device=device, dtype=dtype)
    return weights


