"""Rotary position embedding with the rope variants transformers defines (default, linear, llama3, yarn)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from loraserve.layers.fused_cpu import rotary_

_STATIC_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


def rope_parameters(hf_config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The rope settings of a config, for transformers 5 (`rope_parameters`) and 4 (`rope_scaling`).
    Models with a rope per layer type (Gemma-3: "sliding_attention" / "full_attention") keep one dict
    per type in `rope_parameters`; `layer_type` picks one."""
    params = getattr(hf_config, "rope_parameters", None)
    if isinstance(params, dict) and layer_type is not None and isinstance(params.get(layer_type), dict):
        params = params[layer_type]
    if isinstance(params, dict) and "rope_theta" in params:
        return dict(params)
    scaling = dict(getattr(hf_config, "rope_scaling", None) or {})
    scaling.setdefault("rope_type", scaling.get("type", "default"))
    scaling.setdefault("rope_theta", getattr(hf_config, "rope_theta", 10000.0))
    return scaling


class RotaryEmbedding(nn.Module):
    """Applies rope to q/k given absolute positions; cos/sin come from a precomputed table."""

    cos_table: torch.Tensor
    sin_table: torch.Tensor

    def __init__(
        self, hf_config: Any, head_dim: int, max_positions: int, layer_type: str | None = None
    ) -> None:
        super().__init__()
        params = rope_parameters(hf_config, layer_type)
        rope_type = params.get("rope_type", "default")
        if rope_type not in _STATIC_ROPE_TYPES:
            raise ValueError(
                f"rope_type {rope_type!r} is not supported natively (use model_impl='transformers')."
            )
        if rope_type == "default":
            exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
            inv_freq = 1.0 / (params["rope_theta"] ** exponents)
            scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            init = ROPE_INIT_FUNCTIONS[rope_type]
            device = torch.device("cpu")
            inv_freq, scaling = (
                init(hf_config, device)
                if layer_type is None
                else init(hf_config, device, layer_type=layer_type)
            )
        self.head_dim = head_dim
        self._inv_freq, self._scaling = inv_freq.float().cpu(), scaling
        cos, sin = self._tables(max_positions)
        self.register_buffer("cos_table", cos, persistent=False)
        self.register_buffer("sin_table", sin, persistent=False)

    def _tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32), self._inv_freq)
        emb = torch.cat([freqs, freqs], dim=-1)
        return emb.cos() * self._scaling, emb.sin() * self._scaling

    def cover(self, num_positions: int) -> None:
        """Tables for at least `num_positions` positions: a max_model_len beyond the config's (vLLM's
        VLLM_ALLOW_LONG_MAX_MODEL_LEN) extends the same frequencies. Called before the first forward."""
        if num_positions > self.cos_table.shape[0]:
            cos, sin = self._tables(num_positions)
            device = self.cos_table.device
            self.cos_table, self.sin_table = cos.to(device), sin.to(device)

    def apply_(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        """Rope on the first num_heads heads of every row of x, in place (the half-split layout).
        x [T, >= num_heads * head_dim] with unit column stride (e.g. q and k at the front of a packed
        qkv output); positions [T] int64."""
        rotary_(x, positions, self.cos_table, self.sin_table, num_heads, self.head_dim)
