"""Random PEFT LoRA adapters written straight to disk (no PEFT, no base model in memory): cheap enough
to make a thousand of them for traces over many adapters.

Each adapter is a folder with adapter_config.json and adapter_model.safetensors in PEFT's layout for
a Llama (`base_model.model.model.layers.{i}.self_attn.{proj}.lora_A.weight` [r, in] and `lora_B.weight`
[out, r]), bf16 tensors, attention projections only. Folders are written once, atomically, and reused.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterable

import torch
from safetensors.torch import save_file

ATTENTION_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj")


def adapter_name(index: int) -> str:
    return f"zipf-{index:05d}"


def projection_shapes(model_path: str) -> dict[str, tuple[int, int]]:
    """(in_features, out_features) of each attention projection, from the model's config.json."""
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    hidden = cfg["hidden_size"]
    head_dim = cfg.get("head_dim") or hidden // cfg["num_attention_heads"]
    q_dim = cfg["num_attention_heads"] * head_dim
    kv_dim = cfg.get("num_key_value_heads", cfg["num_attention_heads"]) * head_dim
    return {"q_proj": (hidden, q_dim), "k_proj": (hidden, kv_dim), "v_proj": (hidden, kv_dim),
            "o_proj": (q_dim, hidden)}


def adapter_config(model_path: str, rank: int) -> dict[str, object]:
    return {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": model_path,  # must equal the served model name for the resolver
        "r": rank,
        "lora_alpha": 2 * rank,
        "lora_dropout": 0.0,
        "target_modules": list(ATTENTION_TARGETS),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "modules_to_save": None,
        "inference_mode": True,
    }


def adapter_tensors(shapes: dict[str, tuple[int, int]], num_layers: int, rank: int,
                    seed: int) -> dict[str, torch.Tensor]:
    """Small random A and B (non-zero, so the adapter changes the output without blowing it up)."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(num_layers):
        for proj, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            lora_a = torch.randn(rank, fan_in, generator=g) / fan_in**0.5
            lora_b = torch.randn(fan_out, rank, generator=g) * 0.02
            tensors[f"{prefix}.lora_A.weight"] = lora_a.to(torch.bfloat16)
            tensors[f"{prefix}.lora_B.weight"] = lora_b.to(torch.bfloat16)
    return tensors


def write_adapters(model_path: str, root: str, indices: Iterable[int], rank: int = 8) -> int:
    """Write the adapters `adapter_name(i)` for `i` in `indices` under `root` (those not already
    there); returns how many were written."""
    with open(os.path.join(model_path, "config.json"), encoding="utf-8") as f:
        num_layers = json.load(f)["num_hidden_layers"]
    config = adapter_config(model_path, rank)
    shapes = projection_shapes(model_path)
    os.makedirs(root, exist_ok=True)
    num_written = 0
    for index in sorted(set(indices)):
        folder = os.path.join(root, adapter_name(index))
        if os.path.exists(os.path.join(folder, "adapter_config.json")):
            continue
        staging = folder + ".tmp"
        shutil.rmtree(staging, ignore_errors=True)
        os.makedirs(staging)
        tensors = adapter_tensors(shapes, num_layers, rank, seed=index)
        save_file(tensors, os.path.join(staging, "adapter_model.safetensors"), metadata={"format": "pt"})
        with open(os.path.join(staging, "adapter_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2)
        shutil.rmtree(folder, ignore_errors=True)  # a leftover without its config is incomplete
        os.replace(staging, folder)  # a reader sees a whole adapter or none
        num_written += 1
    return num_written
