"""GPT-2 (and GPT-2-shaped checkpoints such as Cerebras-GPT): learned positions, LayerNorm, Conv1D weights.

HF stores Conv1D weights as [in, out]; they are transposed at load time so every layer is an [out, in]
`Linear`. PEFT adapters for GPT-2 target `c_attn`, `c_proj`, `c_fc` with fan_in_fan_out=True.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.layers.attention import PagedAttention
from loraserve.layers.linear import Linear
from loraserve.models.base import NativeCausalLM

_ACTIVATIONS = {
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
    "relu": F.relu,
    "silu": F.silu,
}


def _layer_norm(size: int, eps: float, dtype: torch.dtype) -> nn.LayerNorm:
    norm = nn.LayerNorm(size, eps=eps, dtype=dtype)
    norm.requires_grad_(False)
    return norm


class GPT2Block(nn.Module):
    def __init__(self, cfg: Any, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads = cfg.n_embd, cfg.n_head
        self.num_heads, self.head_dim = heads, hidden // heads
        inner = cfg.n_inner or 4 * hidden
        scale = 1.0 / math.sqrt(self.head_dim) if cfg.scale_attn_weights else 1.0
        if getattr(cfg, "scale_attn_by_inverse_layer_idx", False):
            scale /= float(layer_idx + 1)
        self.ln_1 = _layer_norm(hidden, cfg.layer_norm_epsilon, dtype)
        self.attn: Any = nn.Module()  # a plain container keeps HF's parameter names (attn.c_attn...)
        self.attn.c_attn = Linear(hidden, 3 * hidden, bias=True, dtype=dtype)
        self.attn.c_proj = Linear(hidden, hidden, bias=True, dtype=dtype)
        self.attn_op = PagedAttention(heads, heads, self.head_dim, scale)
        self.ln_2 = _layer_norm(hidden, cfg.layer_norm_epsilon, dtype)
        self.mlp: Any = nn.Module()
        self.mlp.c_fc = Linear(hidden, inner, bias=True, dtype=dtype)
        self.mlp.c_proj = Linear(inner, hidden, bias=True, dtype=dtype)
        act = cfg.activation_function
        if act not in _ACTIVATIONS:
            raise ValueError(f"activation_function {act!r} is not supported natively.")
        self.act = _ACTIVATIONS[act]

    def forward(self, x: torch.Tensor, kv_cache: KVCache, batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.attn.c_attn(self.ln_1(x), batch).chunk(3, dim=-1)
        attn = self.attn_op(q.contiguous(), k.contiguous(), v.contiguous(), kv_cache, batch.attn)
        x = x + self.attn.c_proj(attn, batch)
        h = self.act(self.mlp.c_fc(self.ln_2(x), batch))
        return x + self.mlp.c_proj(h, batch)


class GPT2LMHeadModel(NativeCausalLM):
    transposed_weight_modules = ("c_attn", "c_proj", "c_fc")
    ignored_weight_suffixes = (".attn.bias", ".attn.masked_bias")

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        if getattr(hf_config, "reorder_and_upcast_attn", False):
            raise ValueError("reorder_and_upcast_attn=True is not supported natively.")
        self.config = hf_config
        self.transformer: Any = nn.Module()
        self.transformer.wte = nn.Embedding(hf_config.vocab_size, hf_config.n_embd, dtype=dtype)
        self.transformer.wpe = nn.Embedding(hf_config.n_positions, hf_config.n_embd, dtype=dtype)
        self.transformer.h = nn.ModuleList(GPT2Block(hf_config, i, dtype) for i in range(hf_config.n_layer))
        self.transformer.ln_f = _layer_norm(hf_config.n_embd, hf_config.layer_norm_epsilon, dtype)
        self.transformer.requires_grad_(False)
        tie = bool(getattr(hf_config, "tie_word_embeddings", True))
        self._build_lm_head(self.transformer.wte, hf_config.vocab_size, tie, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        t = self.transformer
        x = t.wte(input_ids) + t.wpe(positions)
        for block, kv_cache in zip(t.h, kv_caches):
            x = block(x, kv_cache, batch)
        return t.ln_f(x)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        # Bare GPT2Model checkpoints name tensors without the "transformer." prefix.
        super().load_weights(
            (name if name.startswith(("transformer.", "lm_head.")) else f"transformer.{name}", tensor)
            for name, tensor in weights
        )

    def kv_cache_spec(self) -> KVCacheSpec:
        cfg = self.config
        return KVCacheSpec(cfg.n_layer, cfg.n_head, cfg.n_embd // cfg.n_head, None)
