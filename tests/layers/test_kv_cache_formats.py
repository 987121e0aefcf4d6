"""The KV cache's formats (batch/kv_cache.py): what the writers store and what attention reads.

- fp8 (e4m3, e5m2): the C kernel's write (every CPU build) stores exactly torch's rounding of the
  values clamped to the format's range (ties, subnormals, saturation, NaN, signed zeros), at scale 1
  and at another per-tensor scale.
- int8: a block written over several steps (a prefill chunk, then decode rows whose amax grows, a
  block filled in one step, two sequences per step) holds the same bytes and scales from the C kernel
  as from the torch writer after every step, and its values stay within the stated bound of one
  absmax quantization of the block.
- attention over each format (bf16 under float32, fp8, int8) through every CPU build of the kernel,
  the torch twin and Triton (interpreted, or on CUDA): equal to a float64 reference over the
  dequantized cache (float32 summation order only), and within the format's precision of attention
  over the values before quantization.
- the AVX-512 builds (with and without bf16 dot products) compile here; they run where the CPU has them.
"""

from __future__ import annotations

import importlib.util
import os
import platform
import zlib
from typing import Any

import pytest
import torch
from support.attention_reference import (
    AttentionCase,
    AttentionInputs,
    make_inputs,
    reference_attention,
    tolerance,
)

from loraserve.batch.kv_cache import KVCache, KVScales, has_block_scales
from loraserve.layers import paged_attention_cpu, paged_attention_torch
from loraserve.layers.kv_cache_formats import read_rows, write_kv
from loraserve.native.build import cpu_flags, load_library

FP8 = [torch.float8_e4m3fn, torch.float8_e5m2]
KV_DTYPES = [torch.bfloat16, *FP8, torch.int8]
# The kernel's builds: this machine's, and the other CPU classes' code paths that run here.
BUILDS = {"native": None, "avx2": "haswell", "portable": "x86-64"}


@pytest.fixture(scope="module")
def kernels() -> dict[str, Any]:
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


def _empty_cache(num_blocks: int, block_size: int, kv_heads: int, dim: int, dtype: torch.dtype) -> KVCache:
    shape = (num_blocks * block_size, kv_heads, dim)
    scales = KVScales()
    if has_block_scales(dtype):  # unused blocks' scales NaN: reading one shows
        scales = KVScales(
            torch.full((num_blocks, kv_heads), float("nan")), torch.full((num_blocks, kv_heads), float("nan"))
        )
    return KVCache(torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype), scales)


def _kernel_write(
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


def _stored(cache: KVCache) -> list[torch.Tensor]:
    """What the cache holds as comparable bits: K and V bytes, int8's block scales (NaN ones too)."""
    held = [cache.k.view(torch.uint8), cache.v.view(torch.uint8)]
    return held + [
        t.view(torch.int32) for t in (cache.scales.k_blocks, cache.scales.v_blocks) if t is not None
    ]


def _hard_values(seed: int) -> torch.Tensor:
    """Values that test a rounding: ties and near-ties of both fp8 grids, subnormals of both, the range
    edges and past them, signed zeros, inf and NaN, then random magnitudes over 2^-20 .. 2^17."""
    e4m3 = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    e5m2 = torch.arange(0, 256, dtype=torch.uint8).view(torch.float8_e5m2).float()
    grid = torch.cat([e4m3, e5m2])
    grid = grid[grid.isfinite()].unique()
    mids = (grid[1:] + grid[:-1]) / 2  # exact ties between neighbours (the float32 mean is exact here)
    eps = torch.tensor([1 + 2**-20, 1 - 2**-20])
    special = torch.tensor(
        [
            0.0,
            -0.0,
            448.0,
            449.0,
            480.0,
            57344.0,
            61440.0,
            1e9,
            float("inf"),
            float("nan"),
            2**-9,
            2**-10,
            3 * 2**-11,
            2**-16,
            2**-17,
            3 * 2**-18,
        ]
    )
    g = torch.Generator().manual_seed(seed)
    rand = torch.exp2(torch.rand(4096, generator=g) * 37 - 20) * torch.sign(torch.randn(4096, generator=g))
    values = torch.cat([grid, mids, (mids[:, None] * eps).flatten(), special, rand])
    return torch.cat([values, -values])


@pytest.mark.parametrize("scale", [1.0, 0.37])
@pytest.mark.parametrize("dtype", FP8, ids=str)
def test_fp8_write_is_torch_rounding_in_every_build(
    kernels: dict[str, Any], dtype: torch.dtype, scale: float
) -> None:
    kv_heads, dim, block = 2, 33, 8
    per_row = kv_heads * dim
    values = _hard_values(seed=1)
    rows = -(-values.numel() // per_row)
    values = torch.cat([values, values.new_zeros(rows * per_row - values.numel())]).view(rows, per_row)
    expected = _empty_cache(-(-rows // block), block, kv_heads, dim, dtype)
    expected.scales.k, expected.scales.v = scale, 2 * scale
    write_kv(expected, values, -values, torch.arange(rows), block)
    limit = torch.finfo(dtype).max
    want = (values / scale).clamp(-limit, limit).to(dtype).view(torch.uint8)  # what the twin must have stored
    assert torch.equal(expected.k.view(torch.uint8).view(-1, per_row)[:rows], want)
    for name, kernel in kernels.items():
        cache = _empty_cache(-(-rows // block), block, kv_heads, dim, dtype)
        cache.scales.k, cache.scales.v = scale, 2 * scale
        _kernel_write(kernel, cache, values, -values, list(range(rows)), block)
        for mine, twin in zip(_stored(cache), _stored(expected), strict=True):
            assert torch.equal(mine, twin), name


def _int8_steps() -> list[list[tuple[int, int]]]:
    """Steps of (sequence, number of new rows): a prefill chunk ending mid-block, a block filled in one
    step, then decode rows one by one (two sequences per step), one of them over a block boundary."""
    return [[(0, 5), (1, 16)], [(0, 1), (1, 3)], *[[(0, 1), (1, 1)] for _ in range(14)], [(0, 9)]]


@pytest.mark.parametrize("act", [torch.float32, torch.bfloat16], ids=str)
def test_int8_block_scales_follow_rows_written_over_steps(kernels: dict[str, Any], act: torch.dtype) -> None:
    block, kv_heads, dim = 16, 3, 40
    g = torch.Generator().manual_seed(3)
    tables = [[4, 1, 6], [0, 3, 5]]  # each sequence's blocks
    steps = _int8_steps()
    length = [sum(n for s, n in (x for step in steps for x in step) if s == seq) for seq in (0, 1)]
    # Rows whose magnitude grows now and then (a channel with larger values, as K often has), so
    # decode rows raise their block's amax and requantize its earlier rows.
    grow = [torch.cumprod(1 + 0.08 * torch.rand(n, generator=g), 0) for n in length]
    values = [
        (torch.randn(n, 2, kv_heads * dim, generator=g) * grow[i].view(-1, 1, 1)).to(act).float()
        for i, n in enumerate(length)
    ]
    twin = _empty_cache(8, block, kv_heads, dim, torch.int8)
    mine = {name: _empty_cache(8, block, kv_heads, dim, torch.int8) for name in kernels}
    done = [0, 0]
    for step in steps:
        all_slots, all_rows = [], []
        for seq, n in step:
            pos = range(done[seq], done[seq] + n)
            slots = [tables[seq][p // block] * block + p % block for p in pos]
            rows = values[seq][done[seq] : done[seq] + n]
            all_slots += slots
            all_rows.append(rows)
            done[seq] += n
        rows = torch.cat(all_rows)
        write_kv(twin, rows[:, 0], rows[:, 1], torch.tensor(all_slots), block)
        for name, cache in mine.items():
            at = 0
            for _seq, n in step:
                _kernel_write(
                    kernels[name],
                    cache,
                    rows[at : at + n, 0],
                    rows[at : at + n, 1],
                    all_slots[at : at + n],
                    block,
                    act,
                )
                at += n
            for got, want in zip(_stored(cache), _stored(twin), strict=True):
                assert torch.equal(got, want), name
    # Within the stated bound of one absmax quantization per block: RMS error <= 0.5 of the block's
    # ideal step (amax / 127; 0.29 for one rounding), every value within 2.5 steps. (Rows whose
    # magnitude grows at every step are the worst case: a requantization at nearly every decode row.)
    for seq in (0, 1):
        slots = torch.tensor([tables[seq][p // block] * block + p % block for p in range(length[seq])])
        for which, blocks in ((0, twin.scales.k_blocks), (1, twin.scales.v_blocks)):
            stored = twin.k if which == 0 else twin.v
            got = read_rows(stored, slots, block, blocks, 1.0, torch.float64)
            exact = values[seq][:, which].view(-1, kv_heads, dim).double()
            for start in range(0, length[seq], block):
                part = slice(start, start + block)
                step = exact[part].abs().amax(dim=(0, 2)) / 127  # per head
                err = (got[part] - exact[part]) / step.view(1, -1, 1)
                assert err.abs().max() <= 2.5 and err.pow(2).mean().sqrt() <= 0.5


def _quantized(
    case: AttentionCase, inputs: AttentionInputs, kv_dtype: torch.dtype, fp8_scale: float = 1.0
) -> tuple[KVCache, AttentionInputs]:
    """Each sequence's context written into a `kv_dtype` cache by the torch writer (a prefill chunk,
    then rows one by one, so int8 blocks are requantized as they grow), unused slots poisoned (NaN
    bytes, NaN scales); and the inputs with the cache's values (float64) for the reference."""
    bs = case.block_size
    num_blocks = inputs.k_cache.shape[0] // bs
    cache = _empty_cache(num_blocks, bs, case.num_kv_heads, case.head_dim, kv_dtype)
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
    cache, dequantized = _quantized(case, inputs, kv_dtype, fp8_scale=0.5)
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


def test_int8_needs_its_block_scales() -> None:
    case = AttentionCase((1,), (5,), 4, 2, 16, 4, torch.float32)
    inputs = make_inputs(case, seed=9)
    cache, _ = _quantized(case, inputs, torch.int8)
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
    query_lens, context_lens, heads, kv_heads, dim, bs, softcap, window = CASES["decode"]
    case = AttentionCase((1, 4, 1), (17, 40, 9), 6, 2, 33, 5, torch.float32, 5.0, None)
    inputs = make_inputs(case, seed=11)
    cache, dequantized = _quantized(case, inputs, kv_dtype, fp8_scale=0.5)
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
