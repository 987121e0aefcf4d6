"""Llama-family decoder (Llama incl. Llama-3 rope scaling, Mistral sliding window), with packed qkv/gate_up.

Qwen2 (qkv bias) and Qwen3 (q/k norm, explicit head_dim) reuse these blocks through the flags read
from the config in `LlamaArgs.from_config`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraserve import envs
from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.layers.attention import PagedAttention
from loraserve.layers.fused_cpu import silu_and_mul
from loraserve.layers.linear import Linear
from loraserve.layers.norm import RMSNorm
from loraserve.layers.rotary import RotaryEmbedding
from loraserve.models.base import NativeCausalLM
from loraserve.models.llama_stack import BoundObjects, DecoderStack

_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "silu": F.silu,
    "swish": F.silu,
    "gelu": F.gelu,
    "relu": F.relu,
}


@dataclass(frozen=True)
class LlamaArgs:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    qk_norm: bool
    hidden_act: str
    sliding_window: int | None
    sliding_layers: tuple[bool, ...]
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, cfg: Any, qkv_bias: bool | None = None, qk_norm: bool = False) -> LlamaArgs:
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        window = getattr(cfg, "sliding_window", None)
        if getattr(cfg, "use_sliding_window", True) is False:
            window = None
        layer_types = getattr(cfg, "layer_types", None)
        if layer_types is not None:
            sliding = tuple(t == "sliding_attention" for t in layer_types)
        else:
            sliding = tuple(window is not None for _ in range(cfg.num_hidden_layers))
        if not any(sliding):
            window = None
        bias = bool(getattr(cfg, "attention_bias", False))
        act = getattr(cfg, "hidden_act", "silu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported natively (use model_impl='transformers').")
        return cls(
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=num_heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or num_heads,
            head_dim=head_dim,
            vocab_size=cfg.vocab_size,
            rms_norm_eps=cfg.rms_norm_eps,
            max_positions=cfg.max_position_embeddings,
            qkv_bias=bias if qkv_bias is None else qkv_bias,
            o_bias=bias,
            mlp_bias=bool(getattr(cfg, "mlp_bias", False)),
            qk_norm=qk_norm,
            hidden_act=act,
            sliding_window=window,
            sliding_layers=sliding,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
        )


def packed_qkv_attention(
    layer: Any, positions: torch.Tensor, x: torch.Tensor, kv_cache: KVCache,
    batch: ForwardBatch,
) -> torch.Tensor:
    """One attention layer over a packed qkv projection: rope on q and k (after per-head q/k norms where
    the layer has them), paged attention, the output projection. `layer` holds qkv_proj, q_norm, k_norm,
    rotary, num_heads, num_kv_heads, head_dim, split_sizes, attn and o_proj (Llama's and Gemma's do)."""
    num_tokens = x.shape[0]
    qkv = layer.qkv_proj(x, batch)
    if layer.q_norm is None or layer.k_norm is None:
        layer.rotary.apply_(positions, qkv, layer.num_heads + layer.num_kv_heads)  # q and k lead the row
        q, k, v = qkv.split(layer.split_sizes, dim=-1)
    else:
        q, k, v = qkv.split(layer.split_sizes, dim=-1)
        q = layer.q_norm(q.reshape(num_tokens, layer.num_heads, layer.head_dim)).view(num_tokens, -1)
        k = layer.k_norm(k.reshape(num_tokens, layer.num_kv_heads, layer.head_dim)).view(num_tokens, -1)
        layer.rotary.apply_(positions, q, layer.num_heads)
        layer.rotary.apply_(positions, k, layer.num_kv_heads)
    out = layer.attn(q, k, v, kv_cache, batch.attn)
    return layer.o_proj(out, batch)


class LlamaAttention(nn.Module):
    def __init__(self, args: LlamaArgs, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        self.qkv_proj = Linear(args.hidden_size, [q_size, kv_size, kv_size], bias=args.qkv_bias, dtype=dtype)
        self.o_proj = Linear(q_size, args.hidden_size, bias=args.o_bias, dtype=dtype)
        self.q_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None
        self.k_norm = RMSNorm(args.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None
        self.rotary = rotary
        self.attn = PagedAttention(
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
            scale=args.head_dim**-0.5,
            use_sliding_window=args.sliding_layers[layer_idx] and args.sliding_window is not None,
        )
        self.split_sizes = [q_size, kv_size, kv_size]

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: KVCache,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        return packed_qkv_attention(self, positions, x, kv_cache, batch)


class LlamaMLP(nn.Module):
    def __init__(self, args: LlamaArgs, dtype: torch.dtype) -> None:
        super().__init__()
        size = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, [size, size], bias=args.mlp_bias, dtype=dtype)
        self.down_proj = Linear(size, args.hidden_size, bias=args.mlp_bias, dtype=dtype)
        self.act: Callable[[torch.Tensor], torch.Tensor] = _ACTIVATIONS[args.hidden_act]
        self.size = size

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, batch)
        if self.act is F.silu:
            return self.down_proj(silu_and_mul(gate_up), batch)
        gate, up = gate_up.split(self.size, dim=-1)
        return self.down_proj(self.act(gate) * up, batch)


class LlamaDecoderLayer(nn.Module):
    def __init__(self, args: LlamaArgs, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.self_attn = LlamaAttention(args, rotary, layer_idx, dtype)
        self.post_attention_layernorm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.mlp = LlamaMLP(args, dtype)

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        residual: torch.Tensor | None,
        kv_cache: KVCache,
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Pre-norm block with the residual stream carried beside the hidden state: each residual add is
        fused into the norm that follows it. Returns (mlp output, residual so far)."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm.add_and_norm(x, residual)
        h = self.self_attn(positions, h, kv_cache, batch)
        h, residual = self.post_attention_layernorm.add_and_norm(h, residual)
        return self.mlp(h, batch), residual


class LlamaModel(nn.Module):
    def __init__(
        self, args: LlamaArgs, hf_config: Any, dtype: torch.dtype, rotary: RotaryEmbedding | None = None
    ) -> None:
        """`rotary`: the layers' rope, where the model's is not the config's plain one (Phi-3's LongRoPE)."""
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        if rotary is None:
            rotary = RotaryEmbedding(hf_config, args.head_dim, args.max_positions)
        self.layers = nn.ModuleList(LlamaDecoderLayer(args, rotary, i, dtype) for i in range(args.num_layers))
        self.norm = RMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self.rotary: RotaryEmbedding = rotary  # the layers' shared one (registered as theirs first)
        self._stack: DecoderStack | None = None
        self._stack_bound: BoundObjects | None = None  # what the stack (or finding none serves) was built from

    def forward(self, input_ids, positions, kv_caches, batch):  # type: ignore[no-untyped-def]
        # An adapted embedding (`EmbeddingWithLoRA`) takes the step's batch: each row its adapter's terms.
        x = (
            self.embed_tokens(input_ids, batch)
            if getattr(self.embed_tokens, "takes_batch", False)
            else self.embed_tokens(input_ids)
        )
        if batch.embeds is not None:  # a vision-language model's image embeddings
            x = batch.embeds.apply(x)
        # The C stack runs plain rope: M-RoPE's [3, T] positions take the loop.
        stacked = self._run_stack(x, positions, kv_caches, batch) if x.is_cpu and positions.dim() == 1 else None
        if stacked is not None:
            return self.norm.add_and_norm(*stacked)[0]
        residual: torch.Tensor | None = None
        for layer, kv_cache in zip(self.layers, kv_caches):
            x, residual = layer(positions, x, residual, kv_cache, batch)
        return self.norm(x) if residual is None else self.norm.add_and_norm(x, residual)[0]

    def _run_stack(self, x: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                   batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decoder layers as one C call (`llama_stack`), or None: the loop above then runs them."""
        if not envs.cpu_decoder_stack():
            return None
        if self._stack_bound is None or not self._stack_bound.unchanged():
            self._stack_bound = BoundObjects(self.layers, self.rotary)
            self._stack = DecoderStack.build(list(self.layers), self.rotary)
        return None if self._stack is None else self._stack.run(x, positions, kv_caches, batch)


class LlamaForCausalLM(NativeCausalLM):
    packed_modules_mapping = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    qkv_bias: bool | None = None
    qk_norm: bool = False

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.args = LlamaArgs.from_config(hf_config, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)
        self.model = LlamaModel(self.args, hf_config, dtype)
        self._build_lm_head(self.model.embed_tokens, self.args.vocab_size, self.args.tie_word_embeddings, dtype)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, batch)

    def vocab_lora_modules(self) -> dict[str, nn.Module]:
        # A quantized GGUF embedding (QuantEmbedding: blocks, no weight) takes no vocab terms yet;
        # adapters on it are refused by name at load, the head still takes them.
        modules = {"model.embed_tokens": self.model.embed_tokens, "lm_head": self.lm_head}
        return {name: m for name, m in modules.items() if name == "lm_head" or isinstance(m, nn.Embedding)}

    def kv_cache_spec(self) -> KVCacheSpec:
        a = self.args
        return KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, a.sliding_window)


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral is Llama with a sliding window on every layer when `sliding_window` is set."""
