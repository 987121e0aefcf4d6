"""Qwen2 (bias on q/k/v, none on o) and Qwen3 (per-head q/k RMSNorm, explicit head_dim) on the Llama blocks."""

from __future__ import annotations

from loraserve.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
