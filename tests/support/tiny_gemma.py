"""Tiny random Gemma, Gemma-2 and Gemma-3 (text) models shaped like the real configs, scaled down:
GQA, head_dim != hidden / heads, a sliding window shorter than the test prompts, Gemma-2's 1:1 and
Gemma-3's 5:1 sliding/global layers with two rope bases, softcaps that bite, and every norm weight
random (HF initialises them to zero, where (1 + w) and w would differ only by a constant)."""

from __future__ import annotations

import os
import shutil
from typing import Any

import torch
import transformers

GEMMA_ARCHS = ("gemma", "gemma2", "gemma3")
SHARED = dict(
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    initializer_range=0.5,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def gemma_config(arch: str, vocab_size: int) -> Any:
    if arch == "gemma":  # Gemma-7B's full multi-head attention, here 4 heads of 32 over 64
        return transformers.GemmaConfig(
            vocab_size=vocab_size, num_hidden_layers=2, **{**SHARED, "num_key_value_heads": 4}
        )
    if arch == "gemma2":  # Gemma-2-2B: 8 heads over 4 KV heads, 256-wide heads, softcaps 50 / 30
        return transformers.Gemma2Config(
            vocab_size=vocab_size,
            num_hidden_layers=4,
            sliding_window=6,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=3.0,
            final_logit_softcapping=5.0,
            **SHARED,
        )
    if arch == "gemma3":  # Gemma-3-1B: 4 heads over 1 KV head, 5 sliding layers per global one
        rope = {
            "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            "full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1000000.0},
        }
        return transformers.Gemma3TextConfig(
            vocab_size=vocab_size,
            num_hidden_layers=7,
            sliding_window=6,
            query_pre_attn_scalar=24,
            rope_parameters=rope,
            **{**SHARED, "num_key_value_heads": 1},
        )
    raise ValueError(arch)


def save_tiny_gemma(path: str, arch: str, tokenizer_dir: str, vocab_size: int, seed: int = 0) -> Any:
    """Save the model (float32) and the tokenizer's files to `path`; returns the HF model, eval mode.
    arch "gemma3_multimodal": a Gemma3ForConditionalGeneration around the Gemma-3 text model."""
    torch.manual_seed(seed)
    if arch == "gemma3_multimodal":
        vision = dict(
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            image_size=28,
            patch_size=14,
        )
        config = transformers.Gemma3Config(
            text_config=gemma_config("gemma3", vocab_size).to_dict(),
            vision_config=vision,
            mm_tokens_per_image=4,
        )
        model = transformers.Gemma3ForConditionalGeneration(config).eval()
    else:
        model = transformers.AutoModelForCausalLM.from_config(gemma_config(arch, vocab_size)).eval()
    _randomize(model, arch)
    model.save_pretrained(path)
    for name in os.listdir(tokenizer_dir):
        shutil.copy(os.path.join(tokenizer_dir, name), path)
    return model


def _randomize(model: Any, arch: str) -> None:
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.normal_(0.0, 0.3)
            if arch != "gemma" and ("post_attention" in name or "post_feedforward" in name):
                # Sandwich norms set a sublayer's output scale: large enough to compete with the
                # sqrt(hidden)-scaled embedding, as trained ones do, so the model does not just echo its
                # input token through the tied embeddings.
                param.normal_(3.0, 0.5)
            if name.endswith("embed_tokens.weight"):
                param.mul_(0.2)
