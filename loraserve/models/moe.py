"""What the native MoE decoders share: the sparse MLP block and the model around Llama's layers.

Mixtral, Qwen2-MoE, Qwen3-MoE and OLMoE are Llama-family decoders (packed qkv, rope, paged
attention, RMSNorm, the residual stream fused into the norms) whose MLP is a `SparseMoeBlock` on the
layers the config makes sparse: a router (`gate`, [E, H], no LoRA: routing stays the base model's),
`FusedMoE` experts, and Qwen2-MoE's shared expert scaled by sigmoid(`shared_expert_gate`). Layers
outside `mlp_only_layers` and on the `decoder_sparse_step` are sparse (Qwen-MoE); the rest keep a
dense `LlamaMLP`. The layers run as the Python loop (the C decoder stack runs dense layers only).

Checkpoints: the experts load from per-expert tensors (`experts.N.w1/w3/w2`, Mixtral's published
layout under `block_sparse_moe`, or `experts.N.gate_proj/up_proj/down_proj`) or from transformers'
stacked `experts.gate_up_proj` / `experts.down_proj`.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch
from loraserve.layers.fused_moe import FusedMoE, route
from loraserve.layers.linear import Linear
from loraserve.models.base import NativeCausalLM
from loraserve.models.llama import LlamaArgs, LlamaForCausalLM, LlamaMLP, LlamaModel

_EXPERT_TENSOR = re.compile(r"^(?P<block>.+\.mlp)\.experts\.(?P<rest>.+)$")


@dataclass(frozen=True)
class MoeArgs:
    num_experts: int
    top_k: int
    intermediate_size: int
    renormalize: bool
    float32_weights: bool  # Mixtral keeps the routing weights in float32 for the weighted sum
    shared_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[bool, ...]

    @classmethod
    def from_config(cls, cfg: Any, *, mixtral: bool = False) -> MoeArgs:
        if getattr(cfg, "hidden_act", "silu") not in ("silu", "swish"):
            raise ValueError(
                f"MoE experts with hidden_act {cfg.hidden_act!r} are not supported natively "
                "(use model_impl='transformers')."
            )
        num_experts = int(getattr(cfg, "num_local_experts", None) or cfg.num_experts)
        step = int(getattr(cfg, "decoder_sparse_step", 1) or 1)
        dense = set(getattr(cfg, "mlp_only_layers", None) or ())
        sparse = tuple(
            num_experts > 0 and i not in dense and (i + 1) % step == 0 for i in range(cfg.num_hidden_layers)
        )
        return cls(
            num_experts=num_experts,
            top_k=int(cfg.num_experts_per_tok),
            intermediate_size=int(getattr(cfg, "moe_intermediate_size", None) or cfg.intermediate_size),
            renormalize=True if mixtral else bool(getattr(cfg, "norm_topk_prob", False)),
            float32_weights=mixtral,
            shared_intermediate_size=int(getattr(cfg, "shared_expert_intermediate_size", 0) or 0),
            sparse_layers=sparse,
        )


class Router(nn.Module):
    """The router's [E, H] weight: logits = x W^T in the model dtype, as transformers computes them."""

    def __init__(self, num_experts: int, hidden_size: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden_size, dtype=dtype), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class SparseMoeBlock(nn.Module):
    """Router, experts and (Qwen2-MoE) the gated shared expert of one layer."""

    def __init__(self, moe: MoeArgs, args: LlamaArgs, dtype: torch.dtype) -> None:
        super().__init__()
        self.moe = moe
        self.gate = Router(moe.num_experts, args.hidden_size, dtype)
        self.experts = FusedMoE(moe.num_experts, args.hidden_size, moe.intermediate_size, dtype)
        self.shared_expert: LlamaMLP | None = None
        self.shared_expert_gate: Linear | None = None
        if moe.shared_intermediate_size:
            shared = dataclasses.replace(args, intermediate_size=moe.shared_intermediate_size)
            self.shared_expert = LlamaMLP(shared, dtype)
            self.shared_expert_gate = Linear(args.hidden_size, 1, dtype=dtype)

    def forward(self, x: torch.Tensor, batch: ForwardBatch) -> torch.Tensor:
        weights_dtype = torch.float32 if self.moe.float32_weights else x.dtype
        weights, ids = route(self.gate(x), self.moe.top_k, self.moe.renormalize, weights_dtype)
        out = self.experts(x, weights, ids, batch)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x, batch)) * self.shared_expert(x, batch)
        return out


class MoeModel(LlamaModel):
    """Llama's model with each sparse layer's MLP a `SparseMoeBlock`; always the Python loop."""

    def __init__(self, args: LlamaArgs, moe: MoeArgs, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(args, hf_config, dtype)
        for layer, sparse in zip(self.layers, moe.sparse_layers, strict=True):
            if sparse:  # the dense MLP built above was never written (empty tensors, untouched pages)
                layer.mlp = SparseMoeBlock(moe, args, dtype)

    def _run_stack(self, *args: Any) -> None:
        return None  # the C decoder stack runs dense MLPs only


class MoeForCausalLM(LlamaForCausalLM):
    """Base of the native MoE models; subclasses set the Llama flags and `mixtral`."""

    mixtral = False

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        NativeCausalLM.__init__(self)
        self.args = self._llama_args(hf_config)
        self.moe = MoeArgs.from_config(hf_config, mixtral=self.mixtral)
        self.model = MoeModel(self.args, self.moe, hf_config, dtype)
        self._build_lm_head(
            self.model.embed_tokens, self.args.vocab_size, self.args.tie_word_embeddings, dtype
        )

    def _llama_args(self, hf_config: Any) -> LlamaArgs:
        return LlamaArgs.from_config(hf_config, qkv_bias=self.qkv_bias, qk_norm=self.qk_norm)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Expert tensors go to their `FusedMoE` (either layout); the rest load as for Llama."""
        super().load_weights(self._route_experts(weights))

    def _route_experts(
        self, weights: Iterable[tuple[str, torch.Tensor]]
    ) -> Iterator[tuple[str, torch.Tensor]]:
        modules = dict(self.named_modules())
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")  # Mixtral's published name for the block
            match = _EXPERT_TENSOR.match(name)
            experts = modules.get(f"{match['block']}.experts") if match else None
            if match is None or not isinstance(experts, FusedMoE):
                yield name, tensor
                continue
            rest = match["rest"]
            parts = rest.split(".")
            if len(parts) == 1:
                experts.load_fused(rest, tensor.to(experts.gate_up_proj.dtype))
            elif len(parts) == 3 and parts[0].isdigit() and parts[2] == "weight":
                experts.load_expert(int(parts[0]), parts[1], tensor.to(experts.gate_up_proj.dtype))
            else:
                raise ValueError(f"checkpoint tensor {name!r} has no place in {type(self).__name__}")

    def _check_all_loaded(self, loaded: set[str]) -> None:
        complete = {
            f"{name}.{leaf}"
            for name, module in self.named_modules()
            if isinstance(module, FusedMoE) and module.fully_loaded()
            for leaf in ("gate_up_proj", "down_proj")
        }
        super()._check_all_loaded(loaded | complete)
