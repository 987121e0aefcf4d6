"""OLMoE natively: the shared MoE block behind OLMoE's attention.

Its q/k norms are RMSNorms over the whole projected q (num_heads * head_dim) and k (num_kv_heads *
head_dim), not per head as in Qwen3; `clip_qkv` clamps q, k and v after the norms; `attention_bias`
puts a bias on all four projections. Routing renormalises only with `norm_topk_prob` (off in the
published configs).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.layers.attention import PagedAttention
from loraserve.layers.linear import Linear
from loraserve.layers.norm import RMSNorm
from loraserve.layers.rotary import RotaryEmbedding
from loraserve.models.llama import LlamaArgs
from loraserve.models.moe import MoeForCausalLM


class OlmoeAttention(nn.Module):
    def __init__(
        self, args: LlamaArgs, rotary: RotaryEmbedding, clip_qkv: float | None, dtype: torch.dtype
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, [q_size, kv_size, kv_size], bias=args.qkv_bias, dtype=dtype)
        self.o_proj = Linear(q_size, args.hidden_size, bias=args.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(q_size, args.rms_norm_eps, dtype)
        self.k_norm = RMSNorm(kv_size, args.rms_norm_eps, dtype)
        self.rotary = rotary
        self.clip_qkv = clip_qkv
        self.attn = PagedAttention(
            args.num_heads, args.num_kv_heads, args.head_dim, scale=args.head_dim**-0.5
        )
        self.split_sizes = [q_size, kv_size, kv_size]

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: KVCache,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        q, k, v = self.qkv_proj(x, batch).split(self.split_sizes, dim=-1)
        q, k = self.q_norm(q), self.k_norm(k)
        if self.clip_qkv is not None:
            q, k, v = (t.clamp(-self.clip_qkv, self.clip_qkv) for t in (q, k, v))
        self.rotary.apply_(positions, q, self.num_heads)
        self.rotary.apply_(positions, k, self.num_kv_heads)
        return self.o_proj(self.attn(q, k, v, kv_cache, batch.attn), batch)


class OlmoeForCausalLM(MoeForCausalLM):
    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config, dtype)
        clip = getattr(hf_config, "clip_qkv", None)
        for layer in self.model.layers:  # the Llama attention built above was never written
            layer.self_attn = OlmoeAttention(self.args, self.model.rotary, clip, dtype)
