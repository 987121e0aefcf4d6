"""Gemma-3's both-ways image attention (layers/bidirectional_attention.py) over a cache in each KV
format: the span's rows equal the same attention over the cache's rows read back as values
(`kv_cache_formats.read_rows`) and, within the format's rounding, over the float32 rows written, so the
span never reads stored bytes as if they were values."""

from __future__ import annotations

import pytest
import torch

from loraserve.batch.attention_metadata import BidirectionalSpan, build_attention_metadata
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.engine.kv_budget import allocate_kv_caches
from loraserve.layers.bidirectional_attention import attend_spans
from loraserve.layers.kv_cache_formats import write_kv

BLOCK, HEADS, KV_HEADS, DIM, LENGTH = 4, 4, 2, 8, 14
SPAN = (5, 11)  # the image's positions


def _attend(dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    k = torch.randn(LENGTH, KV_HEADS, DIM, generator=g)
    v = torch.randn(LENGTH, KV_HEADS, DIM, generator=g)
    q = torch.randn(LENGTH, HEADS, DIM, generator=g)
    (cache,) = allocate_kv_caches(KVCacheSpec(1, KV_HEADS, DIM, None), 8, BLOCK, dtype, "cpu")
    slots = torch.arange(LENGTH)
    write_kv(cache, k, v, slots, BLOCK)
    meta = build_attention_metadata([LENGTH], [LENGTH], [list(range(8))], BLOCK, "cpu")
    meta.bidirectional = (BidirectionalSpan(0, SPAN[0], SPAN[1], SPAN[0], SPAN[0], SPAN[1]),)
    out = torch.zeros(LENGTH, HEADS, DIM)
    attend_spans(out, q, cache, meta, DIM**-0.5)
    return out[SPAN[0] : SPAN[1]]


@pytest.mark.parametrize(
    ("dtype", "tolerance"),
    [(torch.bfloat16, 0.03), (torch.float8_e4m3fn, 0.15), (torch.float8_e5m2, 0.3), (torch.int8, 0.05)],
)
def test_span_rows_read_the_cache_in_its_format(dtype: torch.dtype, tolerance: float) -> None:
    exact = _attend(torch.float32)
    assert (_attend(dtype) - exact).abs().max().item() < tolerance
