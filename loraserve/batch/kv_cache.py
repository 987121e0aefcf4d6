"""`KVCache`: one layer's paged KV cache as attention writes and reads it, and the element formats it
may hold.

The K and V tensors are [num_blocks * block_size, KVH, D] in the cache's element dtype; that dtype
says how a stored value x_s means the value x (`--kv-cache-dtype`, `cache_config.py`):
- float32, bfloat16, float16: x = x_s.
- float8_e4m3fn, float8_e5m2: x = x_s * scale, one float per tensor (`KVScales.k`, `.v`: 1.0, vLLM's
  scale without calibration). Written as x / scale clamped to the format's largest finite value and
  rounded to nearest even (vLLM's CUDA writer saturates too); a NaN stays NaN.
- int8: x = x_s * scales[block, kv_head], float32 tensors `KVScales.k_blocks`, `.v_blocks`
  [num_blocks, KVH].
  A block's rows arrive over several steps (decode: one a step), so its scale is kept as they come:
  the run of a step's rows that starts a block (its slot 0) sets the scale to amax / 127 over that
  run's rows of the head; a later run whose amax exceeds scale * 127 first requantizes the block's
  earlier rows to the new scale amax / 127 (round(x_s * old / new), in float32), then writes its own.
  A block filled in one step (prefill) is thus exactly per-block absmax; one filled row by row is
  requantized each time its running amax grows (for random rows about ln(block_size) + 0.6 times),
  which measured ~1.2x the rounding error of one quantization (RMS 0.34 of a step, at most ~2 steps;
  tests/layers/test_kv_cache_writes.py holds the bound). Stored values are |x_s| <= 127, round to
  nearest even; amax 0 gives scale 0 (the rows read as 0), a non-finite amax a NaN or inf scale (the
  block reads as NaN: a broken row poisons its own sequence only).
The writers (the C kernel's `write_kv`, `layers/kv_cache_formats.py` for the other paths) follow this
exactly, so a cache written by either reads the same.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
INT8_LEVELS = 127  # |stored| <= 127: symmetric, -128 unused


def has_block_scales(dtype: torch.dtype) -> bool:
    """Whether a cache of this dtype keeps a float32 scale per (block, KV head) for K and V each."""
    return dtype == torch.int8


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 dtype: what a write saturates to."""
    return float(torch.finfo(dtype).max)


@dataclass(slots=True, eq=False)
class KVScales:
    """What turns a quantized cache's stored values into K and V (see the module docstring).
    `kernel_format` is the C kernel's descriptor of the cache, built once by `paged_attention_cpu`."""

    k_blocks: torch.Tensor | None = None  # int8: [num_blocks, KVH] float32, written with the rows
    v_blocks: torch.Tensor | None = None
    k: float = 1.0  # fp8: x = x_s * k
    v: float = 1.0
    kernel_format: Any = field(default=None, repr=False)


def check_scales(dtype: torch.dtype, scales: KVScales | None) -> None:
    """ValueError unless `scales` has what a cache of `dtype` is read with (int8: block scales)."""
    if has_block_scales(dtype) and (scales is None or scales.k_blocks is None or scales.v_blocks is None):
        raise ValueError(
            f"a {dtype} KV cache is read through its block scales (KVScales.k_blocks / v_blocks)"
        )


@dataclass(slots=True, eq=False)
class KVCache:
    """One layer's K and V rows [num_blocks * block_size, KVH, D] in the cache's element dtype, and
    their scales."""

    k: torch.Tensor
    v: torch.Tensor
    scales: KVScales = field(default_factory=KVScales)

    def __post_init__(self) -> None:
        if self.k.dtype != self.v.dtype or self.k.shape != self.v.shape:
            raise ValueError(
                f"K {self.k.dtype} {tuple(self.k.shape)} and V {self.v.dtype} {tuple(self.v.shape)} differ"
            )
        check_scales(self.k.dtype, self.scales)

    @property
    def dtype(self) -> torch.dtype:
        return self.k.dtype

    def copy_block(self, src: int, dst: int, block_size: int) -> None:
        """Block `src`'s rows (and scales) -> block `dst` (a beam's copy on write)."""
        rows = slice(dst * block_size, (dst + 1) * block_size)
        self.k[rows] = self.k[src * block_size : (src + 1) * block_size]
        self.v[rows] = self.v[src * block_size : (src + 1) * block_size]
        for blocks in (self.scales.k_blocks, self.scales.v_blocks):
            if blocks is not None:
                blocks[dst] = blocks[src]
