"""The KV cache's formats (batch/kv_cache.py): what the writers store.

- fp8 (e4m3, e5m2): the C kernel's write (every CPU build) stores exactly torch's rounding of the
  values clamped to the format's range (ties, subnormals, saturation, NaN, signed zeros), at scale 1
  and at another per-tensor scale.
- int8: a block written over several steps (a prefill chunk, then decode rows whose amax grows, a
  block filled in one step, two sequences per step) holds the same bytes and scales from the C kernel
  as from the torch writer after every step, and its values stay within the stated bound of one
  absmax quantization of the block.
What attention reads from each format: test_kv_cache_reads.py.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.kv_formats import FP8, cpu_kernels, empty_cache, kernel_write, stored

from loraserve.layers.kv_cache_formats import read_rows, write_kv


@pytest.fixture(scope="module")
def kernels() -> dict[str, Any]:
    return cpu_kernels()


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
    expected = empty_cache(-(-rows // block), block, kv_heads, dim, dtype)
    expected.scales.k, expected.scales.v = scale, 2 * scale
    write_kv(expected, values, -values, torch.arange(rows), block)
    limit = torch.finfo(dtype).max
    want = (values / scale).clamp(-limit, limit).to(dtype).view(torch.uint8)  # what the twin must have stored
    assert torch.equal(expected.k.view(torch.uint8).view(-1, per_row)[:rows], want)
    for name, kernel in kernels.items():
        cache = empty_cache(-(-rows // block), block, kv_heads, dim, dtype)
        cache.scales.k, cache.scales.v = scale, 2 * scale
        kernel_write(kernel, cache, values, -values, list(range(rows)), block)
        for mine, twin in zip(stored(cache), stored(expected), strict=True):
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
    twin = empty_cache(8, block, kv_heads, dim, torch.int8)
    mine = {name: empty_cache(8, block, kv_heads, dim, torch.int8) for name in kernels}
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
                kernel_write(
                    kernels[name],
                    cache,
                    rows[at : at + n, 0],
                    rows[at : at + n, 1],
                    all_slots[at : at + n],
                    block,
                    act,
                )
                at += n
            for got, want in zip(stored(cache), stored(twin), strict=True):
                assert torch.equal(got, want), name
    # Within the stated bound of one absmax quantization per block: RMS error <= 0.5 of the block's
    # ideal step (amax / 127; 0.29 for one rounding), every value within 2.5 steps. (Rows whose
    # magnitude grows at every step are the worst case: a requantization at nearly every decode row.)
    for seq in (0, 1):
        slots = torch.tensor([tables[seq][p // block] * block + p % block for p in range(length[seq])])
        for which, blocks in ((0, twin.scales.k_blocks), (1, twin.scales.v_blocks)):
            held = twin.k if which == 0 else twin.v
            got = read_rows(held, slots, block, blocks, 1.0, torch.float64)
            exact = values[seq][:, which].view(-1, kv_heads, dim).double()
            for start in range(0, length[seq], block):
                part = slice(start, start + block)
                step = exact[part].abs().amax(dim=(0, 2)) / 127  # per head
                err = (got[part] - exact[part]) / step.view(1, -1, 1)
                assert err.abs().max() <= 2.5 and err.pow(2).mean().sqrt() <= 0.5
