"""`KVCacheSpec`: the shape of the paged KV cache a model asks for, and what one block of it costs."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class KVCacheSpec:
    """Shape of the paged KV cache a model needs (one K and one V tensor per layer).

    rope_switch_length: where the same tokens get other K/V (LongRoPE: a sequence longer than this is
    rotated with the long factors), so the prefix cache keeps such sequences' blocks apart; None: none.
    """

    num_layers: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None = None
    rope_switch_length: int | None = None

    def block_bytes(self, block_size: int, dtype: torch.dtype) -> int:
        """Bytes of one block of `block_size` tokens over every layer's K and V."""
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * block_size * self.num_kv_heads * self.head_dim * elem
