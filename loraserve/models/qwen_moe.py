"""Qwen2-MoE and Qwen3-MoE natively, on the shared MoE block.

Qwen2-MoE: bias on q/k/v (`qkv_bias`), none on o; a shared expert on every sparse layer, scaled by
sigmoid(`shared_expert_gate`); dense layers where `mlp_only_layers` / `decoder_sparse_step` say.
Qwen3-MoE: per-head q/k RMSNorm before rope, an explicit head_dim, `attention_bias` on all four
projections. Both renormalise the top-k weights only with `norm_topk_prob`.
"""

from __future__ import annotations

from typing import Any

from loraserve.models.llama import LlamaArgs
from loraserve.models.moe import MoeForCausalLM


class Qwen2MoeForCausalLM(MoeForCausalLM):
    def _llama_args(self, hf_config: Any) -> LlamaArgs:
        return LlamaArgs.from_config(hf_config, qkv_bias=bool(getattr(hf_config, "qkv_bias", True)))


class Qwen3MoeForCausalLM(MoeForCausalLM):
    qk_norm = True
