"""MoE adapter files in layouts PEFT no longer trains on this transformers: an adapter on per-expert
nn.Linear modules (as older transformers held the experts), and that adapter converted by hand to
PEFT's target_parameters form on the stacked expert tensors (the reference where PEFT itself does
not convert it).
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch
from safetensors.torch import load_file, save_file


def save_per_expert_adapter(hf: Any, folder: str, base_path: str, rank: int = 4) -> None:
    """An adapter as PEFT saved it on older transformers, whose experts were nn.Linear modules
    (Mixtral's `block_sparse_moe.experts.N.w1/w3/w2`, the others' `mlp.experts.N.gate_proj/...`),
    with q_proj beside them; random values (this transformers cannot train that layout)."""
    config = hf.config
    mixtral = config.model_type == "mixtral"
    block, leaves = (
        ("block_sparse_moe", ("w1", "w3", "w2"))
        if mixtral
        else ("mlp", ("gate_proj", "up_proj", "down_proj"))
    )
    num = config.num_local_experts if mixtral else config.num_experts
    hidden = config.hidden_size
    size = config.intermediate_size if mixtral else config.moe_intermediate_size
    g = torch.Generator().manual_seed(11)
    tensors = {}
    for layer in range(config.num_hidden_layers):
        prefix = f"base_model.model.model.layers.{layer}"
        for e in range(0 if layer in (getattr(config, "mlp_only_layers", None) or []) else num):
            for leaf, (fan_in, fan_out) in zip(leaves, [(hidden, size), (hidden, size), (size, hidden)]):
                key = f"{prefix}.{block}.experts.{e}.{leaf}"
                tensors[f"{key}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.2
                tensors[f"{key}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.2
        q = f"{prefix}.self_attn.q_proj"
        tensors[f"{q}.lora_A.weight"] = torch.randn(rank, hidden, generator=g) * 0.2
        tensors[f"{q}.lora_B.weight"] = torch.randn(hidden, rank, generator=g) * 0.2
    os.makedirs(folder, exist_ok=True)
    save_file(tensors, f"{folder}/adapter_model.safetensors")
    adapter_config = dict(
        peft_type="LORA",
        task_type="CAUSAL_LM",
        r=rank,
        lora_alpha=2 * rank,
        base_model_name_or_path=base_path,
        target_modules=["q_proj", *leaves],
    )
    with open(f"{folder}/adapter_config.json", "w", encoding="utf-8") as f:
        json.dump(adapter_config, f)


def as_target_parameters(folder: str, out: str, hf: Any, rank: int = 4) -> None:
    """The per-expert adapter in `folder` rewritten as PEFT's target_parameters adapter on the stacked
    tensors, as PEFT itself converts Mixtral's: per expert A = [A_gate; A_up], B block-diagonal (rank
    2r, alpha 2 alpha: the same scaling); lora_A rows e * rank + j, lora_B columns j * E + e."""
    tensors = load_file(f"{folder}/adapter_model.safetensors")
    with open(f"{folder}/adapter_config.json", encoding="utf-8") as f:
        config = json.load(f)
    num, size = hf.config.num_experts, hf.config.moe_intermediate_size
    converted = {k: v for k, v in tensors.items() if ".experts." not in k}
    for layer in range(hf.config.num_hidden_layers):
        prefix = f"base_model.model.model.layers.{layer}.mlp.experts"
        if f"{prefix}.0.gate_proj.lora_A.weight" not in tensors:
            continue
        gate_up_a, gate_up_b, down_a, down_b = [], [], [], []
        for e in range(num):
            a_g, b_g = (
                tensors[f"{prefix}.{e}.gate_proj.lora_A.weight"],
                tensors[f"{prefix}.{e}.gate_proj.lora_B.weight"],
            )
            a_u, b_u = (
                tensors[f"{prefix}.{e}.up_proj.lora_A.weight"],
                tensors[f"{prefix}.{e}.up_proj.lora_B.weight"],
            )
            gate_up_a.append(torch.cat([a_g, a_u]))
            b = torch.zeros(2 * size, 2 * rank)
            b[:size, :rank], b[size:, rank:] = b_g, b_u
            gate_up_b.append(b)
            down_a.append(tensors[f"{prefix}.{e}.down_proj.lora_A.weight"])
            down_b.append(tensors[f"{prefix}.{e}.down_proj.lora_B.weight"])
        converted[f"{prefix}.base_layer.lora_A.weight"] = torch.cat(gate_up_a)
        converted[f"{prefix}.base_layer.lora_B.weight"] = torch.stack(gate_up_b, -1).flatten(1)
        converted[f"{prefix}.lora_A.weight"] = torch.cat(down_a)
        converted[f"{prefix}.lora_B.weight"] = torch.stack(down_b, -1).flatten(1)
    os.makedirs(out, exist_ok=True)
    save_file(converted, f"{out}/adapter_model.safetensors")
    config |= dict(
        target_modules=["q_proj"],
        target_parameters=["experts.down_proj", "experts.gate_up_proj"],
        rank_pattern={r".*\.gate_up_proj": 2 * rank},
        alpha_pattern={r".*\.gate_up_proj": 4 * rank},
    )
    with open(f"{out}/adapter_config.json", "w", encoding="utf-8") as f:
        json.dump(config, f)
