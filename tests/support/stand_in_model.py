"""A stand-in model for adapter-lifecycle tests: Llama-named `Linear` layers (packed qkv and gate_up,
as the native models pack them) and nothing else, plus PEFT-shaped adapters for it, in memory or on disk."""

from __future__ import annotations

import json
from pathlib import Path

import safetensors.torch
import torch
from torch import nn

from loraserve.layers.linear import Linear
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.peft_helper import PEFTHelper
from loraserve.lora.request import LoRARequest
from loraserve.lora.targets import LoRATargets

H, KV, INTER, RANK = 16, 8, 24, 4


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = Linear(H, [H, KV, KV])
        self.o_proj = Linear(H, H)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = Linear(H, [INTER, INTER])
        self.down_proj = Linear(INTER, H)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attn()
        self.mlp = _Mlp()


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])


class StandInLlama(nn.Module):
    """Linear layers named like a Llama model (the manager only looks at those)."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = Linear(H, 50)
        for p in self.parameters():
            nn.init.normal_(p)


def stand_in_tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in range(2):
        for module, d_in, d_out in (
            ("self_attn.q_proj", H, H),
            ("self_attn.v_proj", H, KV),
            ("mlp.down_proj", INTER, H),
        ):
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(RANK, d_in, generator=g)
            out[f"{prefix}.lora_B.weight"] = torch.randn(d_out, RANK, generator=g)
    return out


CONFIG = {
    "peft_type": "LORA",
    "r": RANK,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj", "down_proj"],
}


def write_stand_in_adapter(folder: Path, seed: int, **config: object) -> Path:
    """An adapter folder (config + safetensors) for StandInLlama, its weights drawn from `seed`."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps({**CONFIG, **config}))
    safetensors.torch.save_file(stand_in_tensors(seed), str(folder / "adapter_model.safetensors"))
    return folder


def stand_in_lora_model(model: nn.Module, lora_id: int) -> LoRAModel:
    """Adapter `ad<lora_id>` (the stand-in tensors of that seed) built for `model`, as a read would."""
    name = f"ad{lora_id}"
    helper = PEFTHelper.from_dict(CONFIG, name, max_lora_rank=8)
    request = LoRARequest(name, lora_id, "")
    return LoRAModel.from_tensors(
        stand_in_tensors(lora_id), request, helper, LoRATargets.from_model(model), torch.float32
    )
