"""`KVCacheSpec`: the shape of the paged KV cache a model asks for, and what one block of it costs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.batch.kv_cache import has_block_scales


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
        """Bytes of one block of `block_size` tokens over every layer's K and V, in the cache's element
        dtype, with the float32 scale per (block, KV head) of K and V each where it keeps them (int8)."""
        elem = torch.empty((), dtype=dtype).element_size()
        scales = 4 if has_block_scales(dtype) else 0
        return 2 * self.num_layers * self.num_kv_heads * (block_size * self.head_dim * elem + scales)
