"""Multimodal rope (Qwen2-VL's M-RoPE): each token has three positions, temporal, height and width;
the rotary frequencies are split in three sections (`mrope_section`, over head_dim / 2), each rotated
by its own position. Text tokens carry the same position three times, which is plain rope; an image's
tokens carry their patch's grid coordinates.

positions [3, T] int64 (a [T] tensor is plain rope). The cos/sin rows are gathered from the same
tables as `RotaryEmbedding`'s, section by section, and applied in float32 in the half-split layout,
as transformers' `apply_multimodal_rotary_pos_emb` does with its recomposed frequencies.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from loraserve.layers.rotary import RotaryEmbedding


class MRotaryEmbedding(RotaryEmbedding):
    component: torch.Tensor

    def __init__(self, hf_config: Any, head_dim: int, max_positions: int, sections: Sequence[int]) -> None:
        super().__init__(hf_config, head_dim, max_positions)
        if sum(sections) != head_dim // 2 or len(sections) != 3:
            raise ValueError(
                f"mrope_section {list(sections)} must be three sections summing to head_dim / 2 = {head_dim // 2}."
            )
        parts = [torch.full((size,), i, dtype=torch.long) for i, size in enumerate(sections)]
        self.register_buffer("component", torch.cat(parts), persistent=False)

    def apply_(self, positions: torch.Tensor, x: torch.Tensor, num_heads: int) -> None:
        if positions.dim() == 1:
            super().apply_(positions, x, num_heads)
            return
        num_tokens, half = x.shape[0], self.head_dim // 2
        columns = torch.arange(half, device=x.device)
        rows = positions[self.component].t()  # [T, half]: each frequency's position
        cos = self.cos_table[rows, columns][:, None, :]
        sin = self.sin_table[rows, columns][:, None, :]
        heads = x[:, : num_heads * self.head_dim].view(num_tokens, num_heads, self.head_dim)
        first, second = heads[..., :half].float(), heads[..., half:].float()
        rotated = torch.cat([first * cos - second * sin, second * cos + first * sin], dim=-1)
        heads.copy_(rotated.to(x.dtype))
