"""Phi-3, Phi-3.5 and Phi-4-mini (`Phi3ForCausalLM`) natively: Llama's decoder with LongRoPE.

The layers are Llama's (RMSNorm, SiLU-gated MLP, GQA, the sliding window on every layer when the
config sets one), so the C decoder stack serves them where it serves Llama. What differs:
- the checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` tensor; they load
  into the same packed layers (split into their slices on load), and the packing mapping makes
  adapters trained on the fused modules apply whole and adapters on q/k/v or gate/up apply as slices;
- rope is `layers.rotary_longrope` (short/long factor sets picked per sequence, partial rotary), whose
  table rows this model computes once per step before the layers run.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import replace
from typing import Any

import torch
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.layers.rotary_longrope import LongRoPERotaryEmbedding
from loraserve.models.llama import LlamaArgs, LlamaForCausalLM, LlamaModel


class Phi3Model(LlamaModel):
    rotary: LongRoPERotaryEmbedding

    def forward(  # type: ignore[override]
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        rows = self.rotary.rope_positions(positions, batch)  # rope table rows: short or long set
        return super().forward(input_ids, rows, kv_caches, batch)


class Phi3ForCausalLM(LlamaForCausalLM):
    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        nn.Module.__init__(self)  # LlamaForCausalLM.__init__ would build Llama's rope
        self.args = LlamaArgs.from_config(hf_config)
        rotary = LongRoPERotaryEmbedding(hf_config, self.args.head_dim, self.args.max_positions)
        self.model = Phi3Model(self.args, hf_config, dtype, rotary)
        self._build_lm_head(
            self.model.embed_tokens, self.args.vocab_size, self.args.tie_word_embeddings, dtype
        )

    def kv_cache_spec(self) -> KVCacheSpec:
        """Llama's cache; sequences past LongRoPE's original length hold other K/V for the same tokens."""
        rotary = self.model.rotary
        assert isinstance(rotary, LongRoPERotaryEmbedding)
        return replace(super().kv_cache_spec(), rope_switch_length=rotary.original if rotary.long else None)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        a = self.args
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        sizes = {"qkv_proj": [q, kv, kv], "gate_up_proj": [a.intermediate_size] * 2}
        super().load_weights(_split_fused(weights, sizes, self.packed_modules_mapping))


def _split_fused(
    weights: Iterable[tuple[str, torch.Tensor]], sizes: dict[str, list[int]], parts: dict[str, list[str]]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Fused checkpoint tensors ("...qkv_proj.weight") as their parts ("...q_proj.weight", ...), the
    names the packed loading knows; a fused tensor of another size is refused by name."""
    for name, tensor in weights:
        module, _, leaf = name.rpartition(".")
        parent, _, fused = module.rpartition(".")
        if fused not in sizes:
            yield name, tensor
            continue
        if tensor.shape[0] != sum(sizes[fused]):
            raise ValueError(
                f"checkpoint tensor {name!r} has {tensor.shape[0]} rows; the config's heads and sizes "
                f"need {sum(sizes[fused])} ({' + '.join(map(str, sizes[fused]))})"
            )
        for part, piece in zip(parts[fused], tensor.split(sizes[fused])):
            yield f"{parent}.{part}.{leaf}", piece
