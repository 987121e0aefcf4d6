"""`read_adapter`: one adapter folder turned into a validated `LoRAModel`, straight through.

The read goes one way, each step on what the previous one returned: adapter_config.json
(`peft_helper`: bounded read, then every field checked), the weights file (`checkpoint`: bounded by
`ReadLimits.max_file_bytes` before a byte is read), the checks of keys, modules, shapes and values
(`adapter_checks`), then the weights by (packed) module (`lora_model`). The model is seen only
through its `LoRATargets`, built once per model by the caller; nothing here calls back into the
caller or caches anything: the caller decides where the result lives (the manager's host cache).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from loraserve.errors import LoRAAdapterError
from loraserve.lora.checkpoint import read_adapter_file
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.peft_helper import PEFTHelper
from loraserve.lora.request import LoRARequest
from loraserve.lora.targets import LoRATargets


@dataclass(frozen=True, slots=True)
class ReadLimits:
    """What a served adapter may be: rank, bias, the dtype and device its weights take in host
    memory, and the largest weights file worth opening (None: no bound)."""

    max_lora_rank: int
    enable_lora_bias: bool
    dtype: torch.dtype
    device: torch.device | str = "cpu"
    max_file_bytes: int | None = None

    @classmethod
    def for_targets(
        cls, targets: LoRATargets, max_lora_rank: int, enable_lora_bias: bool, dtype: torch.dtype
    ) -> ReadLimits:
        """Host-memory limits for a model's targets: a weights file larger than any valid adapter of
        rank <= `max_lora_rank` could be is refused by its size."""
        return cls(max_lora_rank, enable_lora_bias, dtype, "cpu", targets.max_adapter_bytes(max_lora_rank))


def read_adapter(
    folder: str | Path, lora_request: LoRARequest, targets: LoRATargets, limits: ReadLimits
) -> LoRAModel:
    """The adapter in local folder `folder`, read and validated for `targets` within `limits`;
    a `LoRAAdapterError` naming the adapter (and the field or module) otherwise. An `OSError` of
    the files becomes one too: the files are the client's (or a resolver's), never a 500, and the
    path is not echoed (it may be a server path)."""
    name = lora_request.lora_name
    try:
        helper = PEFTHelper.from_local_dir(folder, name, limits.max_lora_rank, limits.enable_lora_bias)
        weights_file = read_adapter_file(Path(folder), name, limits.max_file_bytes)
        return LoRAModel.from_tensors(
            weights_file, lora_request, helper, targets, limits.dtype, limits.device, str(folder)
        )
    except OSError as e:
        raise LoRAAdapterError(f"LoRA adapter '{name}': its files cannot be read ({e.strerror})") from None
