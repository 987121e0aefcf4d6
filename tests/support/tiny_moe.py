"""Tiny random MoE models shaped like the real configs, scaled down: GQA, 8 experts with 2 (or, OLMoE,
4) per token, expert widths != the dense width, Qwen2-MoE's shared expert and a dense layer
(`mlp_only_layers`), Qwen3-MoE's explicit head_dim != hidden / heads, OLMoE's full-width q/k norms and
`clip_qkv`, and a sliding window shorter than the test prompts (Mixtral)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import transformers
from safetensors.torch import save_file

MOE_ARCHS = ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")
SHARED = dict(
    hidden_size=64,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def moe_config(arch: str, vocab_size: int) -> Any:
    if arch == "mixtral":  # Mixtral-8x7B: 8 experts, 2 per token, 32 heads over 8 KV heads
        return transformers.MixtralConfig(
            vocab_size=vocab_size,
            num_hidden_layers=2,
            intermediate_size=96,
            num_local_experts=8,
            num_experts_per_tok=2,
            sliding_window=6,
            **SHARED,
        )
    if arch == "qwen2_moe":  # Qwen1.5-MoE-A2.7B: 60 experts of 1408 and a 5632-wide shared expert
        return transformers.Qwen2MoeConfig(
            vocab_size=vocab_size,
            num_hidden_layers=3,
            intermediate_size=128,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=80,
            num_experts=8,
            num_experts_per_tok=2,
            mlp_only_layers=[1],
            norm_topk_prob=False,
            **SHARED,
        )
    if arch == "qwen3_moe":  # Qwen3-30B-A3B: 128 experts, 8 per token, head_dim 128 over hidden 2048
        return transformers.Qwen3MoeConfig(
            vocab_size=vocab_size,
            num_hidden_layers=2,
            intermediate_size=128,
            moe_intermediate_size=48,
            num_experts=8,
            num_experts_per_tok=2,
            head_dim=32,
            norm_topk_prob=True,
            **SHARED,
        )
    if arch == "olmoe":  # OLMoE-1B-7B: 64 experts, 8 per token, no renormalisation
        return transformers.OlmoeConfig(
            vocab_size=vocab_size,
            num_hidden_layers=2,
            intermediate_size=40,
            num_experts=8,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            clip_qkv=2.0,
            **{**SHARED, "num_key_value_heads": 4},
        )
    raise ValueError(arch)


def save_tiny_moe(path: str, arch: str, tokenizer_dir: str, vocab_size: int, seed: int = 0) -> Any:
    """Save the model (float32, transformers' save_pretrained: per-expert tensors) and the tokenizer's
    files to `path`; returns the HF model, eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(moe_config(arch, vocab_size)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
            if name.endswith("mlp.gate.weight"):
                # Trained routers are decisive; random ones at this width leave near-ties between experts
                # that bf16 rounding (ours or transformers', each elsewhere) flips, a jump in the output.
                param.mul_(4.0)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return model


def save_fused_layout(model: Any, path: str, tokenizer_dir: str) -> None:
    """The same weights as transformers holds them in memory: stacked `experts.gate_up_proj` [E, 2I, H]
    and `experts.down_proj` [E, H, I] (the layout a checkpoint saved without transformers' reverse
    conversion has)."""
    os.makedirs(path, exist_ok=True)
    tensors = {name: t.detach().contiguous().clone() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:
        tensors.pop("lm_head.weight", None)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w", encoding="utf-8") as f:
        json.dump(model.config.to_dict(), f)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
