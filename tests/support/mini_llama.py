"""A still smaller Llama than the tiny models, for tests that build the config dict or the HF model
themselves (here, not in conftest.py: `from conftest import` finds whichever conftest.py a subset of
the suite imported first)."""

from __future__ import annotations

MINI_LLAMA = dict(
    hidden_size=32,
    intermediate_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=300,
    max_position_embeddings=128,
)
