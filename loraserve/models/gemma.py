"""The Gemma family natively: Gemma, Gemma-2 and Gemma-3 (text), with packed qkv/gate_up.

What sets them apart from Llama, all read from the config in `GemmaArgs.from_config`: the (1 + w)
RMSNorm in float32 (`OffsetRMSNorm`), embeddings scaled by sqrt(hidden) rounded to the model dtype,
GeGLU (`hidden_activation`, gelu with the tanh approximation), the attention scale
`query_pre_attn_scalar ** -0.5` (Gemma-2/3), attention and final logit softcapping (Gemma-2),
"sandwich" norms around attention and the MLP (Gemma-2/3), alternating sliding-window and global layers
(`layer_types`: 1:1 in Gemma-2, 5:1 in Gemma-3), and in Gemma-3 per-head q/k norms and a second rope
base for the sliding layers. On CPU the layers run as one C call per step (`gemma_stack`: the C
decoder stack with Gemma's norms, GeGLU, q/k norms, softcap and per-layer rope tables); the Python
loop here runs the same kernels (C linear kernel, the fused (1 + w) norm and GeGLU, paged attention
with softcap and per-layer window, LoRA ops) and serves every step the stack does not.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraserve import envs
from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.layers.attention import PagedAttention
from loraserve.layers.fused_cpu import gelu_tanh_and_mul
from loraserve.layers.linear import Linear
from loraserve.layers.norm import OffsetRMSNorm
from loraserve.layers.rotary import RotaryEmbedding
from loraserve.models.base import NativeCausalLM
from loraserve.models.gemma_stack import GemmaBoundObjects, GemmaDecoderStack, refresh_scales
from loraserve.models.llama import packed_qkv_attention

# transformers' names for the activations Gemma checkpoints use (`ACT2FN`): the tanh approximation
# under every name that means it.
_ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"),
    "gelu_tanh": partial(F.gelu, approximate="tanh"),
    "gelu": F.gelu,
}
_TANH = frozenset({"gelu_pytorch_tanh", "gelu_tanh"})  # run by the fused GeGLU kernel
SLIDING, FULL = "sliding_attention", "full_attention"


def _layer_types(cfg: Any, default_pattern: int) -> tuple[str, ...]:
    """Per-layer attention kind: the config's `layer_types`, else its sliding pattern (every
    `pattern`-th layer global; Gemma-2: 2, Gemma-3: `sliding_window_pattern`, 6), else all global."""
    types = getattr(cfg, "layer_types", None)
    if types:
        return tuple(str(t) for t in types)
    pattern = getattr(cfg, "sliding_window_pattern", None) or getattr(cfg, "_sliding_window_pattern", None)
    pattern = pattern or default_pattern
    if not pattern or getattr(cfg, "sliding_window", None) is None:
        return (FULL,) * cfg.num_hidden_layers
    return tuple(SLIDING if (i + 1) % pattern else FULL for i in range(cfg.num_hidden_layers))


@dataclass(frozen=True)
class GemmaArgs:
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_positions: int
    attention_bias: bool
    activation: str
    scale: float
    attn_softcap: float | None
    final_softcap: float | None
    sliding_window: int | None
    layer_types: tuple[str, ...]
    sandwich_norms: bool
    qk_norm: bool
    local_rope: bool
    tie_word_embeddings: bool

    @classmethod
    def from_config(cls, cfg: Any, version: int) -> GemmaArgs:
        num_heads = cfg.num_attention_heads
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // num_heads
        act = (
            getattr(cfg, "hidden_activation", None) or getattr(cfg, "hidden_act", None) or "gelu_pytorch_tanh"
        )
        if act not in _ACTIVATIONS:
            raise ValueError(
                f"hidden_activation {act!r} is not supported natively (use model_impl='transformers')."
            )
        types = (
            _layer_types(cfg, {1: 0, 2: 2, 3: 6}[version]) if version > 1 else (FULL,) * cfg.num_hidden_layers
        )
        window = getattr(cfg, "sliding_window", None) if SLIDING in types else None
        if window is None:
            types = (FULL,) * cfg.num_hidden_layers
        scalar = getattr(cfg, "query_pre_attn_scalar", None) if version > 1 else None
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
            attention_bias=bool(getattr(cfg, "attention_bias", False)),
            activation=act,
            scale=(scalar or head_dim) ** -0.5,
            attn_softcap=getattr(cfg, "attn_logit_softcapping", None) if version > 1 else None,
            final_softcap=getattr(cfg, "final_logit_softcapping", None) if version > 1 else None,
            sliding_window=window,
            layer_types=types,
            sandwich_norms=version > 1,
            qk_norm=version == 3,
            local_rope=version == 3,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", True)),
        )


class GemmaAttention(nn.Module):
    def __init__(self, args: GemmaArgs, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        q_size, kv_size = args.num_heads * args.head_dim, args.num_kv_heads * args.head_dim
        bias = args.attention_bias
        self.qkv_proj = Linear(args.hidden_size, [q_size, kv_size, kv_size], bias=bias, dtype=dtype)
        self.o_proj = Linear(q_size, args.hidden_size, bias=bias, dtype=dtype)
        self.q_norm = OffsetRMSNorm(args.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None
        self.k_norm = OffsetRMSNorm(args.head_dim, args.rms_norm_eps, dtype) if args.qk_norm else None
        self.rotary = rotary
        sliding = args.layer_types[layer_idx] == SLIDING
        self.attn = PagedAttention(
            args.num_heads,
            args.num_kv_heads,
            args.head_dim,
            scale=args.scale,
            use_sliding_window=sliding,
            softcap=args.attn_softcap,
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


class GemmaMLP(nn.Module):
    """GeGLU: down(act(gate) * up), gate and up one packed linear."""

    def __init__(self, args: GemmaArgs, dtype: torch.dtype) -> None:
        super().__init__()
        size = args.intermediate_size
        self.gate_up_proj = Linear(args.hidden_size, [size, size], bias=False, dtype=dtype)
        self.down_proj = Linear(size, args.hidden_size, bias=False, dtype=dtype)
        self.act = _ACTIVATIONS[args.activation]
        self.tanh_gelu = args.activation in _TANH
        self.size = size

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        gate_up = self.gate_up_proj(x, batch)
        if self.tanh_gelu:
            return self.down_proj(gelu_tanh_and_mul(gate_up), batch)
        gate, up = gate_up.split(self.size, dim=-1)
        return self.down_proj(self.act(gate) * up, batch)


class GemmaDecoderLayer(nn.Module):
    def __init__(self, args: GemmaArgs, rotary: RotaryEmbedding, layer_idx: int, dtype: torch.dtype) -> None:
        super().__init__()
        size, eps = args.hidden_size, args.rms_norm_eps
        self.input_layernorm = OffsetRMSNorm(size, eps, dtype)
        self.self_attn = GemmaAttention(args, rotary, layer_idx, dtype)
        self.post_attention_layernorm = OffsetRMSNorm(size, eps, dtype)
        self.mlp = GemmaMLP(args, dtype)
        # Gemma-2/3 norm each sublayer's output too; Gemma's post_attention_layernorm is its pre-MLP norm.
        self.pre_feedforward_layernorm = OffsetRMSNorm(size, eps, dtype) if args.sandwich_norms else None
        self.post_feedforward_layernorm = OffsetRMSNorm(size, eps, dtype) if args.sandwich_norms else None

    def forward(
        self,
        positions: torch.Tensor,
        x: torch.Tensor,
        kv_cache: KVCache,
        batch: ForwardBatch,
    ) -> torch.Tensor:
        """x [T, hidden] -> x after this layer; the residual adds round to the dtype, as HF's do. Gemma-2/3
        add each sublayer's normed output to x in place (x is the model's own stream)."""
        h = self.self_attn(positions, self.input_layernorm(x), kv_cache, batch)
        if self.pre_feedforward_layernorm is None or self.post_feedforward_layernorm is None:
            x = x + h
            return x + self.mlp(self.post_attention_layernorm(x), batch)
        x = self.post_attention_layernorm.add_to(h, x)
        return self.post_feedforward_layernorm.add_to(self.mlp(self.pre_feedforward_layernorm(x), batch), x)


class GemmaModel(nn.Module):
    def __init__(self, args: GemmaArgs, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(args.vocab_size, args.hidden_size, dtype=dtype)
        self.embed_tokens.weight.requires_grad_(False)
        # HF multiplies by sqrt(hidden) rounded to the model dtype (a bf16 constant in bf16).
        self.embed_scale = float(torch.tensor(math.sqrt(args.hidden_size), dtype=dtype).item())
        if args.local_rope:  # Gemma-3: one rope per layer kind (a local base for the sliding layers)
            ropes = {
                kind: RotaryEmbedding(hf_config, args.head_dim, args.max_positions, layer_type=kind)
                for kind in sorted(set(args.layer_types))
            }
        else:
            shared = RotaryEmbedding(hf_config, args.head_dim, args.max_positions)
            ropes = {kind: shared for kind in set(args.layer_types)}
        self.layers = nn.ModuleList(
            GemmaDecoderLayer(args, ropes[kind], i, dtype) for i, kind in enumerate(args.layer_types)
        )
        self.norm = OffsetRMSNorm(args.hidden_size, args.rms_norm_eps, dtype)
        self._stack: GemmaDecoderStack | None = None
        self._stack_bound: GemmaBoundObjects | None = (
            None  # what the stack (or finding none serves) was built from
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        x = self.embed_tokens(input_ids) * self.embed_scale
        if batch.embeds is not None:  # Gemma-3's image embeddings, placed after the scaling as in HF
            x = batch.embeds.apply(x)
        # The C stack attends causally: a step with image tokens that see each other takes the loop.
        stacked = (
            self._run_stack(x, positions, kv_caches, batch)
            if x.is_cpu and not batch.attn.bidirectional
            else None
        )
        if stacked is not None:
            out, stream = stacked
            # Gemma-2/3's stream is complete; Gemma's last MLP output is still to be added, as below.
            return self.norm(stream if self._stack is not None and self._stack.sandwich else stream + out)
        for layer, kv_cache in zip(self.layers, kv_caches):
            x = layer(positions, x, kv_cache, batch)
        return self.norm(x)

    def _run_stack(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: ForwardBatch,
    ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The decoder layers as one C call (`gemma_stack`), or None: the loop above then runs them."""
        if not envs.cpu_decoder_stack():
            return None
        refresh_scales(self.layers)
        if self._stack_bound is None or not self._stack_bound.unchanged():
            self._stack_bound = GemmaBoundObjects(self.layers)
            self._stack = GemmaDecoderStack.build_gemma(list(self.layers))
        return None if self._stack is None else self._stack.run(x, positions, kv_caches, batch)


class GemmaForCausalLM(NativeCausalLM):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }
    version = 1

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__()
        # A multimodal config (Gemma-3's) holds the language model's in `text_config`.
        text = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.args = GemmaArgs.from_config(text, self.version)
        self.model = GemmaModel(self.args, text, dtype)
        self._build_lm_head(
            self.model.embed_tokens, self.args.vocab_size, self.args.tie_word_embeddings, dtype
        )

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, batch)

    def compute_logits(
        self, hidden: torch.Tensor, float32: bool = True, lora: LoRABatchMapping | None = None
    ) -> torch.Tensor:
        """Logits with Gemma-2's final softcap, cap * tanh(logits / cap), computed in float32. `lora` is
        always None: Gemma offers no vocab modules to adapters (`vocab_lora_modules`)."""
        cap = self.args.final_softcap
        logits = self.lm_head.base_forward(hidden)
        if cap is None:
            return logits.float() if float32 else logits
        capped = torch.tanh(logits.float() / cap) * cap
        return capped if float32 else capped.to(logits.dtype)

    def kv_cache_spec(self) -> KVCacheSpec:
        a = self.args
        return KVCacheSpec(a.num_layers, a.num_kv_heads, a.head_dim, a.sliding_window)


class Gemma2ForCausalLM(GemmaForCausalLM):
    version = 2
