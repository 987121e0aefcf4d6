"""Adapters on separate q/k/v and gate/up modules, and their exact equivalents on fused modules
(Phi-3's qkv_proj and gate_up_proj), for PEFT to score: PEFT applies an adapter only to the module
names the model has, so an adapter trained on the parts is checked through the fused one it equals."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import safetensors.torch
import torch

PHI3_PARTS = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}


def fused_sizes(config: Any) -> dict[str, list[int]]:
    """The output slices of Phi-3's fused modules under `config`."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    return {"qkv_proj": [q, kv, kv], "gate_up_proj": [config.intermediate_size] * 2}


def save_split_adapter(config: Any, out: str, seed: int, base_name: str, **lora_kwargs: Any) -> None:
    """A PEFT adapter trained-shaped on a Llama of `config`'s shapes: its module names are the parts."""
    import transformers

    from loraserve.demo.random_model import save_peft_adapter

    head_dim = config.hidden_size // config.num_attention_heads
    llama = transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=config.vocab_size,
            hidden_size=config.hidden_size,
            intermediate_size=config.intermediate_size,
            num_hidden_layers=config.num_hidden_layers,
            num_attention_heads=config.num_attention_heads,
            num_key_value_heads=config.num_key_value_heads,
            head_dim=getattr(config, "head_dim", None) or head_dim,
        )
    )
    save_peft_adapter(llama, out, seed=seed, base_name=base_name, **lora_kwargs)


def split_to_fused(folder: str, out: str, parts: dict[str, list[str]], sizes: dict[str, list[int]]) -> None:
    """The PEFT adapter on fused modules equivalent to one on their parts: A stacked by rank, B block-diagonal."""
    tensors = safetensors.torch.load_file(os.path.join(folder, "adapter_model.safetensors"))
    config = json.loads(Path(folder, "adapter_config.json").read_text())
    fused: dict[str, torch.Tensor] = {}
    for key, value in tensors.items():
        if not any(f".{p}." in key for subs in parts.values() for p in subs):
            fused[key] = value
    modules = {key.rsplit(".", 2)[0] for key in tensors}  # "<parent>.<leaf>"
    for whole, subs in parts.items():
        for parent in sorted({m.rpartition(".")[0] for m in modules if m.rpartition(".")[2] in subs}):
            a = [tensors.get(f"{parent}.{s}.lora_A.weight") for s in subs]
            b = [tensors.get(f"{parent}.{s}.lora_B.weight") for s in subs]
            rank = next(t.shape[0] for t in a if t is not None)
            in_features = next(t.shape[1] for t in a if t is not None)
            stacked_a = torch.cat([t if t is not None else torch.zeros(rank, in_features) for t in a])
            block_b = torch.zeros(sum(sizes[whole]), rank * len(subs))
            row = 0
            for j, (t, size) in enumerate(zip(b, sizes[whole], strict=True)):
                if t is not None:
                    block_b[row : row + size, j * rank : (j + 1) * rank] = t
                row += size
            fused[f"{parent}.{whole}.lora_A.weight"] = stacked_a
            fused[f"{parent}.{whole}.lora_B.weight"] = block_b
    os.makedirs(out, exist_ok=True)
    # A fused module of n parts has rank n r and alpha n alpha: the same scaling (alpha / r, and with
    # rsLoRA alpha / sqrt(r) rescaled below). The other targets stay as they are.
    r, alpha = config["r"], config["lora_alpha"]
    targets = set(config["target_modules"])
    kept = sorted(targets - {p for subs in parts.values() for p in subs})
    fused_targets = sorted(whole for whole, subs in parts.items() if targets & set(subs))
    alphas = {
        whole: alpha * (len(subs) ** 0.5 if config.get("use_rslora") else len(subs))
        for whole, subs in parts.items()
    }
    config.update(
        r=r,
        lora_alpha=alpha,
        target_modules=fused_targets + kept,
        rank_pattern={whole: r * len(subs) for whole, subs in parts.items()},
        alpha_pattern=alphas,
    )
    Path(out, "adapter_config.json").write_text(json.dumps(config))
    safetensors.torch.save_file(fused, os.path.join(out, "adapter_model.safetensors"))
