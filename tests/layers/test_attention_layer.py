"""The attention layer: per-step metadata, the KV write, and the same result on both CPU routes
(the C kernel, and the torch twin with LORASERVE_CPU_ATTENTION_KERNEL=0), for every KV-cache format:
both routes write the same bytes (and int8 scales) and attend over them as the float64 reference does."""

from __future__ import annotations

import pytest
import torch
from support.attention_reference import AttentionCase, AttentionInputs, reference_attention, tolerance

from loraserve.batch.attention_metadata import build_attention_metadata
from loraserve.batch.kv_cache import KVCache, KVScales, has_block_scales
from loraserve.layers.attention import PagedAttention
from loraserve.layers.kv_cache_formats import read_rows, write_kv

BLOCK_SIZE = 4


def test_metadata_maps_tokens_to_their_slots() -> None:
    tables = [[5, 2, 9], [7], [1, 3, 0, 8, 6]]
    query_lens, context_lens = [3, 1, 17], [10, 2, 17]
    meta = build_attention_metadata(query_lens, context_lens, tables, BLOCK_SIZE, "cpu", sliding_window=6)
    expected_slots = [
        tables[b][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
        for b, (q, ctx) in enumerate(zip(query_lens, context_lens))
        for p in range(ctx - q, ctx)
    ]
    assert meta.slot_mapping.tolist() == expected_slots
    assert meta.block_tables.dtype == torch.int32
    assert meta.block_tables.tolist() == [[5, 2, 9, 0, 0], [7, 0, 0, 0, 0], [1, 3, 0, 8, 6]]
    assert meta.context_lens.tolist() == context_lens
    assert meta.query_starts.tolist() == [0, 3, 4, 21]
    assert (meta.num_seqs, meta.max_query_len, meta.max_context_len, meta.sliding_window) == (3, 17, 17, 6)


def _filled_cache(num_slots: int, kv_heads: int, dim: int, kv_dtype: torch.dtype, g: torch.Generator) -> KVCache:
    """A cache of `kv_dtype` whose every slot holds a random row, written block by block in slot order."""
    blocks = num_slots // BLOCK_SIZE
    scales = KVScales(torch.zeros(blocks, kv_heads), torch.zeros(blocks, kv_heads)) if has_block_scales(kv_dtype) \
        else KVScales()
    cache = KVCache(torch.zeros(num_slots, kv_heads, dim, dtype=kv_dtype),
                    torch.zeros(num_slots, kv_heads, dim, dtype=kv_dtype), scales)
    rows = (torch.randn(num_slots, kv_heads, dim, generator=g), torch.randn(num_slots, kv_heads, dim, generator=g))
    write_kv(cache, *rows, torch.arange(num_slots), BLOCK_SIZE)
    return cache


def _values(cache: KVCache) -> tuple[torch.Tensor, torch.Tensor]:
    """The cache's K and V as the values they stand for, in float64."""
    slots = torch.arange(cache.k.shape[0])
    s = cache.scales
    return (read_rows(cache.k, slots, BLOCK_SIZE, s.k_blocks, s.k, torch.float64),
            read_rows(cache.v, slots, BLOCK_SIZE, s.v_blocks, s.v, torch.float64))


def _layer_step(
    layer: PagedAttention, case: AttentionCase, tables: list[list[int]], window: int | None, seed: int,
    kv_dtype: torch.dtype | None = None,
) -> tuple[torch.Tensor, AttentionInputs, KVCache]:
    """One step through the layer over caches whose earlier tokens are already written; returns the
    output, the inputs as the reference reads them (the caches after the write, as values) and the cache."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = case.num_heads, case.num_kv_heads, case.head_dim
    num_slots = (max(max(t) for t in tables) + 1) * BLOCK_SIZE
    cache = _filled_cache(num_slots, kv_heads, dim, kv_dtype or case.dtype, g)
    num_tokens = sum(case.query_lens)
    qkv = torch.randn(num_tokens, (heads + 2 * kv_heads) * dim, generator=g).to(case.dtype)
    q, k, v = qkv.split([heads * dim, kv_heads * dim, kv_heads * dim], dim=1)
    meta = build_attention_metadata(list(case.query_lens), list(case.context_lens), tables, BLOCK_SIZE, "cpu",
                                    sliding_window=window)
    out = layer(q, k, v, cache, meta)
    assert out.shape == (num_tokens, heads * dim) and out.dtype == case.dtype
    if kv_dtype is None:
        torch.testing.assert_close(cache.k[meta.slot_mapping], k.reshape(num_tokens, kv_heads, dim), rtol=0, atol=0)
        torch.testing.assert_close(cache.v[meta.slot_mapping], v.reshape(num_tokens, kv_heads, dim), rtol=0, atol=0)
    k_values, v_values = _values(cache)
    inputs = AttentionInputs(q.reshape(num_tokens, heads, dim), k_values, v_values, tables, meta.block_tables,
                             meta.context_lens, meta.query_starts)
    return out, inputs, cache


STEPS = {
    "decode": ((1, 1, 1), (9, 30, 4)),
    "mixed": ((1, 12, 1), (9, 30, 4)),
    "long_prefill": ((1, 73, 1), (9, 84, 4)),
}


@pytest.mark.parametrize("is_sliding", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("step", list(STEPS))
def test_every_route_gives_the_reference_result(
    monkeypatch: pytest.MonkeyPatch, step: str, dtype: torch.dtype, is_sliding: bool
) -> None:
    query_lens, context_lens = STEPS[step]
    blocks = [(ctx + BLOCK_SIZE - 1) // BLOCK_SIZE for ctx in context_lens]
    pool = torch.randperm(sum(blocks) + 3, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [pool[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(blocks))]
    layer = PagedAttention(6, 2, 64, 64**-0.5, use_sliding_window=is_sliding, softcap=None)
    case = AttentionCase(query_lens, context_lens, 6, 2, 64, BLOCK_SIZE, dtype, None, 7 if is_sliding else None)
    outputs = []
    for kernel_switch in ("1", "0"):
        monkeypatch.setenv("LORASERVE_CPU_ATTENTION_KERNEL", kernel_switch)
        # The model's window is 7; only a layer that uses it applies it.
        out, inputs, _ = _layer_step(layer, case, tables, window=7, seed=1)
        expected = reference_attention(case, inputs).reshape(out.shape)
        torch.testing.assert_close(out.double(), expected, **tolerance(dtype))
        outputs.append(out)
    torch.testing.assert_close(outputs[0].double(), outputs[1].double(), **tolerance(dtype))


KV_DTYPES = [torch.bfloat16, torch.float8_e4m3fn, torch.float8_e5m2, torch.int8]


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("step", list(STEPS))
def test_every_route_writes_and_reads_each_kv_format_alike(
    monkeypatch: pytest.MonkeyPatch, step: str, dtype: torch.dtype, kv_dtype: torch.dtype
) -> None:
    """A step into a quantized (or bf16) cache: the C kernel's write and the torch writer leave the same
    bytes and int8 scales (decode rows land mid-block: int8 requantizes the block's earlier rows), and
    both routes attend over what was written as the float64 reference over its values does."""
    query_lens, context_lens = STEPS[step]
    blocks = [(ctx + BLOCK_SIZE - 1) // BLOCK_SIZE for ctx in context_lens]
    pool = torch.randperm(sum(blocks) + 3, generator=torch.Generator().manual_seed(0)).tolist()
    tables = [pool[sum(blocks[:i]) : sum(blocks[: i + 1])] for i in range(len(blocks))]
    layer = PagedAttention(6, 2, 64, 64**-0.5)
    case = AttentionCase(query_lens, context_lens, 6, 2, 64, BLOCK_SIZE, dtype)
    caches, outputs = [], []
    for kernel_switch in ("1", "0"):
        monkeypatch.setenv("LORASERVE_CPU_ATTENTION_KERNEL", kernel_switch)
        out, inputs, cache = _layer_step(layer, case, tables, window=None, seed=2, kv_dtype=kv_dtype)
        expected = reference_attention(case, inputs).reshape(out.shape)
        torch.testing.assert_close(out.double(), expected, **tolerance(dtype))
        caches.append(cache)
        outputs.append(out)
    for mine, twin in zip(_stored(caches[0]), _stored(caches[1]), strict=True):
        assert torch.equal(mine, twin)
    torch.testing.assert_close(outputs[0].double(), outputs[1].double(), **tolerance(dtype))


def _stored(cache: KVCache) -> list[torch.Tensor]:
    """What the cache holds, as comparable tensors: K and V as bytes, int8's block scales."""
    held = [cache.k.view(torch.uint8), cache.v.view(torch.uint8)]
    return held + [t for t in (cache.scales.k_blocks, cache.scales.v_blocks) if t is not None]


def test_kernel_refuses_slots_past_the_cache_before_writing() -> None:
    """The C kernel writes the new K/V rows itself; a slot past the cache must fail the step with
    nothing written (as index_copy_ would refuse it)."""
    from loraserve.layers import paged_attention_cpu

    if not paged_attention_cpu.kernel_available():
        pytest.skip("no C compiler: the CPU attention kernel cannot be built")
    layer = PagedAttention(4, 2, 8, 8**-0.5)
    caches = KVCache(torch.zeros(2 * BLOCK_SIZE, 2, 8), torch.zeros(2 * BLOCK_SIZE, 2, 8))
    meta = build_attention_metadata([2], [2], [[1]], BLOCK_SIZE, "cpu")
    meta.slot_mapping = torch.tensor([BLOCK_SIZE, 2 * BLOCK_SIZE])  # the second is one past the cache
    q, k, v = torch.randn(2, 32), torch.randn(2, 16), torch.randn(2, 16)
    with pytest.raises(ValueError, match="outside the KV cache"):
        layer(q, k, v, caches, meta)
    assert not caches.k.any() and not caches.v.any()
