"""The KV cache's formats (batch/kv_cache.py): what attention reads.

- attention over each format (bf16 under float32, fp8, int8) through every CPU build of the kernel,
  the torch twin and Triton (interpreted, or on CUDA): equal to a float64 reference over the
  dequantized cache (float32 summation order only), and within the format's precision of attention
  over the values before quantization; int8 is never read without its block scales.
- the AVX-512 builds (with and without bf16 dot products) compile here; they run where the CPU has them.
What the writers store: test_kv_cache_writes.py.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import zlib
from typing import Any

import pytest
import torch
from support.attention_reference import AttentionCase, make_inputs, reference_attention, tolerance
from support.kv_formats import KV_DTYPES, cpu_kernels, quantized

from loraserve.batch.kv_cache import KVCache, KVScales
from loraserve.layers import paged_attention_cpu, paged_attention_torch
from loraserve.native.build import load_library


@pytest.fixture(scope="module")
def kernels() -> dict[str, Any]:
    return cpu_kernels()


# Attention over the quantized values against attention over the values before quantization, for
# unit-variance K, V and outputs of about unit size: (RMS, max) of the error, about half and four times
# the format's unit roundoff u (bf16 2^-9, e4m3 2^-4, e5m2 2^-3; int8: amax / 254 of a block of
# ~3.5-sigma values, ~0.014). Measured: RMS 0.3u, max 1.8-3.8u.
FORMAT_TOLERANCE = {
    torch.bfloat16: (0.002, 0.02),
    torch.float8_e4m3fn: (0.03, 0.25),
    torch.float8_e5m2: (0.06, 0.5),
    torch.int8: (0.01, 0.08),
}
CASES = {  # (query_lens, context_lens, num_heads, num_kv_heads, head_dim, block_size, softcap, window)
    "decode": ((1, 1, 1, 1), (1, 17, 40, 130), 12, 4, 64, 16, None, None),
    "prefill_chunks": ((7, 20), (30, 20), 8, 2, 33, 5, 5.0, None),
    "mixed_mqa": ((1, 9, 1), (50, 9, 16), 40, 1, 64, 16, None, 12),
}


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
@pytest.mark.parametrize("name", list(CASES))
def test_every_cpu_build_and_the_twin_read_each_format_in_place(
    kernels: dict[str, Any], name: str, kv_dtype: torch.dtype, act: torch.dtype
) -> None:
    query_lens, context_lens, heads, kv_heads, dim, bs, softcap, window = CASES[name]
    case = AttentionCase(query_lens, context_lens, heads, kv_heads, dim, bs, act, softcap, window)
    inputs = make_inputs(case, seed=zlib.crc32(repr((name, str(kv_dtype))).encode()))
    cache, dequantized = quantized(case, inputs, kv_dtype, fp8_scale=0.5)
    expected = reference_attention(case, dequantized)
    exact = reference_attention(case, inputs)
    args = (inputs.block_tables, inputs.context_lens, inputs.query_starts, bs, case.scale, softcap, window)
    twin = paged_attention_torch.paged_attention(inputs.q, cache.k, cache.v, *args, scales=cache.scales)
    outputs = {"twin": twin}
    for build, kernel in kernels.items():
        outputs[build] = paged_attention_cpu.run_kernel(
            kernel, inputs.q, cache.k, cache.v, *args, scales=cache.scales
        )
    for label, out in outputs.items():
        assert out.dtype == act and out.shape == inputs.q.shape, label
        torch.testing.assert_close(out.double(), expected, **tolerance(act), msg=label)
        error = out.double() - exact
        rms, largest = FORMAT_TOLERANCE[kv_dtype]
        assert error.pow(2).mean().sqrt() <= rms and error.abs().max() <= largest, label


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=str)
def test_every_fp8_code_reads_exactly(kernels: dict[str, Any], kv_dtype: torch.dtype, act: torch.dtype) -> None:
    """A query over one key gives it probability 1, so the output is that key's V row: every finite fp8
    code of both signs (two KV heads of 128 codes, NaN and infinity as 0) read back exactly by every
    build (every fp8 value is a bf16), whichever way it decodes (float16 widening, bf16 table)."""
    codes = torch.arange(256, dtype=torch.uint8)
    values = codes.view(kv_dtype).float()
    codes[~values.isfinite()] = 0
    expected = codes.view(kv_dtype).float().reshape(1, 2, 128) * 0.5  # the cache's v scale
    v_cache = codes.reshape(1, 2, 128).view(kv_dtype).repeat(4, 1, 1)
    k_cache = torch.zeros_like(v_cache)
    q = torch.ones(1, 2, 128, dtype=act)
    args = (torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32))
    scales = KVScales(k=1.0, v=0.5)
    for build, kernel in kernels.items():
        out = paged_attention_cpu.run_kernel(
            kernel, q, k_cache, v_cache, *args, torch.tensor([0, 1], dtype=torch.int32), 4, 0.1, scales=scales
        )
        assert torch.equal(out.float(), expected), build


@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_a_non_finite_query_gives_its_head_nan(kernels: dict[str, Any], kv_dtype: torch.dtype) -> None:
    """A query head holding inf (a model gone wrong) comes out NaN (where its values are not 0) through
    every build and format, as the float paths give it, never the finite numbers integer rounding
    (int8 under bf16) would make of it; the other heads keep their values."""
    case = AttentionCase((1, 1), (20, 37), 8, 2, 64, 16, torch.bfloat16)
    inputs = make_inputs(case, seed=5)
    cache, _ = quantized(case, inputs, kv_dtype, fp8_scale=0.5)
    q = inputs.q.clone()
    q[1, 5, 3] = float("inf")
    args = (inputs.block_tables, inputs.context_lens, inputs.query_starts, case.block_size, case.scale)
    clean = paged_attention_torch.paged_attention(inputs.q, cache.k, cache.v, *args, scales=cache.scales)
    for build, kernel in kernels.items():
        out = paged_attention_cpu.run_kernel(kernel, q, cache.k, cache.v, *args, scales=cache.scales)
        assert out[1, 5].isnan().sum() >= 60, build
        out[1, 5] = clean[1, 5]
        torch.testing.assert_close(out.double(), clean.double(), **tolerance(torch.bfloat16), msg=build)


def test_int8_needs_its_block_scales() -> None:
    case = AttentionCase((1,), (5,), 4, 2, 16, 4, torch.float32)
    inputs = make_inputs(case, seed=9)
    cache, _ = quantized(case, inputs, torch.int8)
    args = (inputs.block_tables, inputs.context_lens, inputs.query_starts, 4, case.scale)
    assert paged_attention_cpu.serves(inputs.q, cache.k, cache.v, scales=cache.scales)
    assert not paged_attention_cpu.serves(inputs.q, cache.k, cache.v)
    with pytest.raises(ValueError, match="block scales"):
        paged_attention_torch.paged_attention(inputs.q, cache.k, cache.v, *args)
    with pytest.raises(ValueError, match="block scales"):
        KVCache(cache.k, cache.v)
    wrong = KVScales(cache.scales.k_blocks[1:], cache.scales.v_blocks[1:])  # type: ignore[index]
    if paged_attention_cpu.kernel_available():
        with pytest.raises(ValueError, match="block scales of shape"):
            paged_attention_cpu.paged_attention(inputs.q, cache.k, cache.v, *args, scales=wrong)


@pytest.mark.parametrize("arch", ["skylake-avx512", "sapphirerapids"])
def test_avx512_builds_compile(arch: str) -> None:
    """The AVX-512 paths (sapphirerapids: with bf16 pair dot products) build here; this machine runs them
    only if it has the instructions (the tests above then take them as its native build)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 -march values")
    if paged_attention_cpu.kernel_function() is None:
        pytest.skip("no C compiler")
    lib = load_library("paged_attention.c", arch=arch)
    assert lib is not None and paged_attention_cpu.bind(lib) is not None


def _triton_device() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return None
    if torch.cuda.is_available():
        return "cuda"
    return "cpu" if os.environ.get("TRITON_INTERPRET") == "1" else None


@pytest.mark.skipif(_triton_device() is None, reason="needs CUDA + Triton (or TRITON_INTERPRET=1)")
@pytest.mark.parametrize("kv_dtype", KV_DTYPES, ids=str)
def test_triton_reads_each_format(kv_dtype: torch.dtype) -> None:
    from loraserve.layers import paged_attention_triton

    device = _triton_device()
    assert device is not None
    case = AttentionCase((1, 4, 1), (17, 40, 9), 6, 2, 33, 5, torch.float32, 5.0, None)
    inputs = make_inputs(case, seed=11)
    cache, dequantized = quantized(case, inputs, kv_dtype, fp8_scale=0.5)
    expected = reference_attention(case, dequantized)
    to = [
        t.to(device)
        for t in (inputs.q, cache.k, cache.v, inputs.block_tables, inputs.context_lens, inputs.query_starts)
    ]
    scales = KVScales(
        *(None if t is None else t.to(device) for t in (cache.scales.k_blocks, cache.scales.v_blocks)),
        cache.scales.k,
        cache.scales.v,
    )
    out = paged_attention_triton.paged_attention(
        *to,
        case.block_size,
        case.scale,
        case.softcap,
        case.window,
        max_query_len=max(case.query_lens),
        scales=scales,
    )
    torch.testing.assert_close(out.double().cpu(), expected, **tolerance(torch.float32))
