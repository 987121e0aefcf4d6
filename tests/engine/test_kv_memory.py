"""`zeroed_kv_tensor`: zeros of the right shape and dtype, writable, page-aligned on CPU, and lazily
committed: a 1 GiB cache raises RSS by about what is written to it, not by its size."""

from __future__ import annotations

import resource

import pytest
import torch

from loraserve.engine.kv_memory import zeroed_kv_tensor


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_zeros_of_the_shape_and_dtype_and_writable(dtype: torch.dtype) -> None:
    t = zeroed_kv_tensor((64, 2, 8), dtype, "cpu")
    assert t.shape == (64, 2, 8) and t.dtype == dtype and t.is_contiguous()
    assert t.data_ptr() % 4096 == 0 and not t.any()
    t[3, 1].fill_(2.0)
    assert t.sum().item() == 16.0
    assert zeroed_kv_tensor((0, 2, 8), dtype, "cpu").numel() == 0


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def test_a_big_cache_costs_only_the_pages_written() -> None:
    before = _rss_bytes()
    cache = zeroed_kv_tensor((1 << 28,), torch.float32, "cpu")  # 1 GiB
    untouched = _rss_bytes() - before
    cache[: 1 << 22].fill_(1.0)  # 16 MiB written
    written = _rss_bytes() - before
    assert untouched < 8 << 20, untouched
    assert 16 << 20 <= written < 64 << 20, written
    assert cache[(1 << 22) - 1].item() == 1.0 and cache[1 << 22].item() == 0.0
