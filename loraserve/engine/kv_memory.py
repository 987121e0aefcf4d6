"""`zeroed_kv_tensor`: the memory of one KV-cache tensor, zero-filled without being touched on CPU.

Why: `torch.zeros` writes every byte, so a 1 GiB cache (the default) costs ~0.4 s at each engine start
and counts in RSS from the first moment. An anonymous memory map is zero-filled by the kernel page by
page on first write: the engine starts at once, and RSS grows with the KV blocks sequences really use
(which the RSS bound of a quantized model is measured against). Other devices take `torch.zeros`.
"""

from __future__ import annotations

import math
import mmap

import torch


def zeroed_kv_tensor(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """A zero tensor of `shape`; on CPU backed by an anonymous map (page-aligned, lazily committed)."""
    num_bytes = math.prod(shape) * dtype.itemsize
    if torch.device(device).type != "cpu" or num_bytes == 0:
        return torch.zeros(shape, dtype=dtype, device=device)
    buffer = mmap.mmap(-1, num_bytes)  # the tensor keeps the map alive
    return torch.frombuffer(buffer, dtype=dtype).view(shape)
