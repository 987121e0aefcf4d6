"""A tiny random Gemma-2 (softcapped attention and logits, alternating sliding window), saved without
any tokenizer file: for token-id-only serving and the transformers backend's softcapping."""

from __future__ import annotations

from typing import Any

import torch
import transformers


def save_tiny_gemma2(path: str, seed: int) -> Any:
    """Save the model to `path`; returns it (eval mode) as the transformers oracle."""
    config = transformers.Gemma2Config(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, sliding_window=4, attn_logit_softcapping=2.0,
        final_logit_softcapping=3.0, query_pre_attn_scalar=8, initializer_range=0.5, max_position_embeddings=64,
    )
    torch.manual_seed(seed)
    model = transformers.Gemma2ForCausalLM(config).eval()
    model.save_pretrained(path)
    return model
