"""Tiny random Phi-3 models shaped like the real configs, scaled down: fused qkv_proj/gate_up_proj in
the checkpoint, LongRoPE with an original length (24) shorter than the longer test prompts and
factors far from 1 (so short and long sets differ), and
- "phi3.5": Phi-3.5-mini's full multi-head attention over head_dim 24 (96 there: not a power of two),
  full rotary, a sliding window shorter than the prompts (Phi-3-mini-4k has one);
- "phi4": Phi-4-mini's GQA (3 query heads per KV head), partial rotary 0.75, tied embeddings.
"""

from __future__ import annotations

import json
import os
import shutil
from typing import Any

import torch
import transformers

PHI3_ARCHS = ("phi3.5", "phi4")
ORIGINAL = 24


def _factors(n: int, low: float, high: float) -> list[float]:
    return torch.linspace(low, high, n).tolist()


def phi3_config(arch: str, vocab_size: int) -> Any:
    shared = dict(
        vocab_size=vocab_size,
        max_position_embeddings=256,
        original_max_position_embeddings=ORIGINAL,
        initializer_range=0.15,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
    )
    if arch == "phi3.5":
        rotary = 24 // 2
        rope = dict(
            rope_type="longrope",
            rope_theta=10000.0,
            partial_rotary_factor=1.0,
            short_factor=_factors(rotary, 1.0, 2.0),
            long_factor=_factors(rotary, 1.5, 24.0),
        )
        return transformers.Phi3Config(
            hidden_size=96,
            intermediate_size=160,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=4,
            sliding_window=12,
            rope_parameters=rope,
            **shared,
        )
    if arch == "phi4":
        rotary = int(32 * 0.75) // 2
        rope = dict(
            rope_type="longrope",
            rope_theta=250000.0,
            partial_rotary_factor=0.75,
            short_factor=_factors(rotary, 1.0, 3.0),
            long_factor=_factors(rotary, 2.0, 40.0),
        )
        return transformers.Phi3Config(
            hidden_size=192,
            intermediate_size=256,
            num_hidden_layers=2,
            num_attention_heads=6,
            num_key_value_heads=2,
            tie_word_embeddings=True,
            rope_parameters=rope,
            **shared,
        )
    raise ValueError(arch)


def save_tiny_phi3(path: str, arch: str, tokenizer_dir: str, vocab_size: int, seed: int = 0) -> Any:
    """Save the model (float32) and the tokenizer's files to `path`; returns the HF model, eval mode."""
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(phi3_config(arch, vocab_size)).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(1.0, 0.3)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return model


def respell_as_su(path: str) -> None:
    """Rewrite the saved config as early Phi-3 checkpoints spell it: `rope_scaling` of type "su" and
    the original length at the top level (what transformers itself cannot parse)."""
    config_file = os.path.join(path, "config.json")
    with open(config_file, encoding="utf-8") as f:
        raw = json.load(f)
    rope = raw.pop("rope_parameters")
    raw["rope_theta"] = rope.pop("rope_theta")
    raw["partial_rotary_factor"] = rope.pop("partial_rotary_factor", 1.0)
    raw["original_max_position_embeddings"] = rope.pop("original_max_position_embeddings", ORIGINAL)
    rope.pop("rope_type", None)
    raw["rope_scaling"] = {"type": "su", **rope}
    with open(config_file, "w", encoding="utf-8") as f:
        json.dump(raw, f)
