"""Helpers of the KV-cache format tests (tests/layers/test_kv_cache_writes.py, _reads.py): the C
attention kernel's builds that run here, empty caches of each format, a write through the kernel, a
cache's stored bits, and a cache filled by the torch writer as a sequence fills it."""

from __future__ import annotations

import platform
from typing import Any

import pytest
import torch

from loraserve.batch.kv_cache import KVCache, KVScales, has_block_scales
from loraserve.layers import paged_attention_cpu
from loraserve.layers.kv_cache_formats import read_rows, write_kv
from loraserve.native.build import cpu_flags, load_library
from support.attention_reference import AttentionCase, AttentionInputs

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
KV_DTYPES = [torch.bfloat16, *FP8, torch.int8]
# The kernel's builds: this machine's, and the other CPU classes' code paths that run here.
BUILDS = {"native": None, "avx2": "haswell", "portable": "x86-64"}


def cpu_kernels() -> dict[str, Any]:
    """Every build of the kernel that runs here, by name (skips the test without a C compiler)."""
    if paged_attention_cpu.kernel_function() is None:
        pytest.skip("no C compiler: the CPU attention kernel cannot be built")
    built = {"native": paged_attention_cpu.kernel_function()}
    if platform.machine() in ("x86_64", "AMD64"):
        for name, arch in BUILDS.items():
            if arch is None or (name == "avx2" and not {"avx2", "fma", "f16c"} <= cpu_flags()):
                continue
            lib = load_library("paged_attention.c", arch=arch)
            assert lib is not None
            built[name] = paged_attention_cpu.bind(lib)
    return built


def empty_cache(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype) -> KVCache:
    shape = (num_blocks * block_size, kv_heads, dim)
    scales = KVScales()
    if has_block_scales(dtype):  # unused blocks' scales NaN: reading one shows
        scales = KVScales(
            torch.full((num_blocks, kv_heads), float("nan")), torch.full((num_blocks, kv_heads), float("nan"))
        )
    return KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), scales)


def kernel_write(
    kernel: Any,
    cache: KVCache,
    k: torch.Tensor,
    v: torch.Tensor,
    slots: list[int],
    block_size: int,
    act: torch.dtype = torch.float32,
) -> None:
    """Rows k, v [T, KVH * D] into `slots` through the kernel's write (one sequence's step whose queries
    attend over the rows just written: the slots must be its context's last T positions)."""
    num_tokens, kv_heads, dim = len(slots), cache.k.shape[1], cache.k.shape[2]
    k, v = k.to(act).contiguous(), v.to(act).contiguous()
    slot_mapping = torch.tensor(slots, dtype=torch.int64)
    first_block = slots[0] // block_size
    blocks = list(range(first_block, slots[-1] // block_size + 1))
    context = slots[-1] - first_block * block_size + 1
    tables = torch.tensor([blocks], dtype=torch.int32)
    q = torch.zeros(num_tokens, kv_heads, dim, dtype=act)
    paged_attention_cpu.run_kernel(
        kernel,
        q,
        cache.k,
        cache.v,
        tables,
        torch.tensor([context], dtype=torch.int32),
        torch.tensor([0, num_tokens], dtype=torch.int32),
        block_size,
        1.0,
        new_kv=(k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slot_mapping.data_ptr()),
        scales=cache.scales,
    )


def stored(cache: KVCache) -> list[torch.Tensor]:
    """What the cache holds as comparable bits: K and V bytes, int8's block scales (NaN ones too)."""
    held = [cache.k.view(torch.uint8), cache.v.view(torch.uint8)]
    return held + [
        t.view(torch.int32) for t in (cache.scales.k_blocks, cache.scales.v_blocks) if t is not None
    ]


def quantized(
    case: AttentionCase, inputs: AttentionInputs, kv_dtype: torch.dtype, fp8_scale: float = 1.0
) -> tuple[KVCache, AttentionInputs]:
    """Each sequence's context written into a `kv_dtype` cache by the torch writer (a prefill chunk,
    then rows one by one, so int8 blocks are requantized as they grow), unused slots poisoned (NaN
    bytes, NaN scales); and the inputs with the cache's values (float64) for the reference."""
    bs = case.block_size
    num_blocks = inputs.k_cache.shape[0] // bs
    cache = empty_cache(num_blocks, bs, case.num_kv_heads, case.head_dim, kv_dtype)
    if kv_dtype in FP8:
        cache.k.view(torch.uint8).fill_(0x7F)  # NaN
        cache.v.view(torch.uint8).fill_(0x7F)
        cache.scales.k, cache.scales.v = fp8_scale, 2 * fp8_scale
    k_values, v_values = inputs.k_cache.float(), inputs.v_cache.float()
    for blocks, ctx in zip(inputs.tables, case.context_lens, strict=True):
        slots = torch.tensor([blocks[p // bs] * bs + p % bs for p in range(ctx)])
        first = ctx // 2
        write_kv(cache, k_values[slots[:first]], v_values[slots[:first]], slots[:first], bs)
        for p in range(first, ctx):
            write_kv(cache, k_values[slots[p : p + 1]], v_values[slots[p : p + 1]], slots[p : p + 1], bs)
    every = torch.arange(inputs.k_cache.shape[0])
    s = cache.scales
    dequantized = AttentionInputs(
        inputs.q,
        read_rows(cache.k, every, bs, s.k_blocks, s.k, torch.float64),
        read_rows(cache.v, every, bs, s.v_blocks, s.v, torch.float64),
        inputs.tables,
        inputs.block_tables,
        inputs.context_lens,
        inputs.query_starts,
    )
    return cache, dequantized
