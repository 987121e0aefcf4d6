"""Every code path of the fused CPU LoRA kernel, not only the one -march=native picks on this CPU:
AVX-512 without AVX512-BF16, AVX2 and portable C are built with flags that turn the wider ISAs off
(where this CPU can run the result), then held to the float64 reference, the torch twin, slot -1 and
NaN isolation, in float32 and bfloat16; and the slot writes, which must equal torch's bit for bit."""

from __future__ import annotations

import platform

import pytest
import torch
from support.lora_reference import (
    assert_within_bf16_ulps,
    lora_magnitude,
    make_buffers,
    naive_lora,
    run_cpu_kernel,
)

from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.lora.ops import lora_cpu, lora_torch
from loraserve.lora.ops.block_writer import BlockWriter
from loraserve.native.build import cpu_flags
from loraserve.native.kernel_slot import KernelSlot

# name: (flags after -march=native, CPU flags the build needs, code paths it must report)
BUILDS: dict[str, tuple[tuple[str, ...], set[str], set[str] | None]] = {
    "native": ((), set(), None),
    "avx512": (("-mno-avx512bf16",), {"avx512f", "avx512bw", "avx2", "fma"}, {"avx2", "avx512"}),
    "avx2": (("-mno-avx512f",), {"avx2", "fma"}, {"avx2"}),
    "portable": (("-mno-avx",), set(), set()),
}
R = 8
IN = 300  # the bf16 dot products' 128-wide blocks, a 32-wide step and a masked / scalar tail
SIZES = [300, 131, 77]  # a packed layer; one slice spans two expand chunks, none is a multiple of 16
NUM_SLOTS = 5
MIXES = {
    "decode_grid": [s for s in range(NUM_SLOTS) for _ in range(2)],
    "some_without": [-1, 2, 2, -1, 0, 4, 2, -1, 0, 0, 3],
    "one_long_run": [1] * 32,
    "single_tokens": [4, 3, -1, 1, 0, 2],
    # 11 and 5 tokens: expand groups and token blocks that do not divide them (partial blocks of 3 and 1)
    "uneven_runs": [1] * 11 + [-1] + [3] * 5,
    # prefill: segments past the old 32 / 128-token limits, each cut into many token groups
    "long_runs": [2] * 300 + [0] * 129 + [-1] * 3 + [4] * 70,
}


@pytest.fixture(params=list(BUILDS))
def build(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Swaps the named build in for the process's own one."""
    name = request.param
    flags, needs, paths = BUILDS[name]
    if not lora_cpu.kernel_available():
        pytest.skip("no C compiler: the CPU kernel is not built here")
    if name != "native" and (platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags()):
        pytest.skip(f"the {name} build needs an x86-64 CPU with {sorted(needs)}")
    built = lora_cpu.build_kernels(flags)
    assert built is not None, f"the {name} build failed"
    assert paths is None or built.code_paths == paths  # the flags really selected that path
    if "avx512_bf16" in built.code_paths:
        assert "avx512_bf16" in cpu_flags()
    monkeypatch.setattr(lora_cpu, "_kernel", KernelSlot.holding(built))
    return name


def _layer(dtype: torch.dtype, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """Block-diagonal A [L, 3R, IN] and Bt [L, 3R, out] with ranks per slot and slice (0 included)."""
    g = torch.Generator().manual_seed(seed)
    ranks = torch.tensor([[8, 3, 0], [1, 8, 5], [0, 0, 0], [8, 8, 8], [6, 0, 2]], dtype=torch.int32)
    offsets = [0, *torch.tensor(SIZES).cumsum(0).tolist()]
    a, bt = torch.zeros(NUM_SLOTS, 3 * R, IN), torch.zeros(NUM_SLOTS, 3 * R, offsets[-1])
    for s in range(NUM_SLOTS):
        for q in range(3):
            r = int(ranks[s, q])
            a[s, q * R : q * R + r] = torch.randn(r, IN, generator=g)
            bt[s, q * R : q * R + r, offsets[q] : offsets[q + 1]] = torch.randn(r, SIZES[q], generator=g) / 4
    return a.to(dtype), bt.to(dtype), ranks, offsets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mix", list(MIXES))
def test_every_build_matches_reference(build: str, mix: str, dtype: torch.dtype) -> None:
    slots = MIXES[mix]
    a, bt, ranks, offsets = _layer(dtype, seed=1)
    buffers = make_buffers(a, bt, offsets, ranks)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(len(slots), IN + 5, generator=g)[:, 2 : 2 + IN].to(dtype)  # strided rows
    y0 = torch.randn(len(slots), offsets[-1], generator=g).to(dtype)
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=NUM_SLOTS)
    if mapping.segments.max_len > lora_cpu.max_segment_len(dtype):
        pytest.skip(f"the {build} build leaves {mapping.segments.max_len}-token {dtype} segments to torch")
    y = run_cpu_kernel(y0.clone(), x, buffers, mapping)
    none_rows = [i for i, s in enumerate(slots) if s < 0]
    assert torch.equal(y[none_rows], y0[none_rows])
    assert lora_cpu.kernel_build() is not None
    t_dtype = lora_cpu.kernel_build().t_dtype(dtype)  # bf16 in the AVX512-BF16 build: the reference rounds t as it does
    _, delta = naive_lora(x, a, bt.transpose(1, 2), slots, scale=1.0, t_dtype=t_dtype)
    y_torch = lora_torch.add_lora(y0.clone(), x.contiguous(), a, bt.transpose(1, 2), mapping)
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), y0.double() + delta, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(y, y_torch, atol=1e-4, rtol=1e-4)
        return
    # Each element of y rounded once, to nearest, from the sum over t as the reference rounds it: half
    # an ulp of what it sums (plus float32 noise); the twin (which also rounds t, and the products) 1.5.
    magnitude = y0.double().abs() + lora_magnitude(x, a, bt.transpose(1, 2), slots)
    assert_within_bf16_ulps(y, y0.double() + delta, magnitude, ulps=0.6)
    assert_within_bf16_ulps(y_torch, y0.double() + delta, magnitude, ulps=2)


# (max_rank, ranks per slot and slice): past the bf16 expand's 32-rank block of t pairs (two blocks, the
# second partial, odd or even); a max_rank that is not a multiple of 4 (rows of t at any even address).
HIGH_RANKS = {
    "max_rank_40": (40, [[40, 37], [33, 1], [32, 39], [1, 0]]),
    "max_rank_5": (5, [[5, 3], [1, 5], [4, 2], [1, 0]]),
}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(HIGH_RANKS))
def test_every_build_matches_reference_at_high_ranks(build: str, case: str, dtype: torch.dtype) -> None:
    """Ranks of every parity, a rank of 1 (a lone row paired with zeros) and of 0, over two slices, in
    short runs and a 30-token segment (every build takes it); every element outside the adapters' blocks (rows past a rank,
    off-diagonal blocks) is NaN, which the kernel must never read."""
    max_rank, rank_table = HIGH_RANKS[case]
    sizes, slots = [131, 70], [0, 0, 1, 2, 2, 2, 2, 2, 3, -1, 1] + [2] * 25
    offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
    ranks = torch.tensor(rank_table, dtype=torch.int32)
    g = torch.Generator().manual_seed(8)
    a, bt = torch.zeros(4, 2 * max_rank, IN), torch.zeros(4, 2 * max_rank, offsets[-1])
    for s in range(4):
        for q in range(2):
            r = int(ranks[s, q])
            a[s, q * max_rank : q * max_rank + r] = torch.randn(r, IN, generator=g)
            bt[s, q * max_rank : q * max_rank + r, offsets[q] : offsets[q + 1]] = torch.randn(r, sizes[q], generator=g) / 4
    a, bt = a.to(dtype), bt.to(dtype)
    a_nan, bt_nan = a.clone(), bt.clone()
    for s in range(4):
        for q in range(2):
            r = int(ranks[s, q])
            a_nan[s, q * max_rank + r : (q + 1) * max_rank] = float("nan")
            bt_nan[s, q * max_rank + r : (q + 1) * max_rank] = float("nan")
            bt_nan[s, q * max_rank : q * max_rank + r, : offsets[q]] = float("nan")
            bt_nan[s, q * max_rank : q * max_rank + r, offsets[q + 1] :] = float("nan")
    x = torch.randn(len(slots), IN, generator=g).to(dtype)
    y0 = torch.randn(len(slots), offsets[-1], generator=g).to(dtype)
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=4)
    y = run_cpu_kernel(y0.clone(), x, make_buffers(a_nan, bt_nan, offsets, ranks, max_rank), mapping)
    assert lora_cpu.kernel_build() is not None
    _, delta = naive_lora(x, a, bt.transpose(1, 2), slots, scale=1.0, t_dtype=lora_cpu.kernel_build().t_dtype(dtype))
    if dtype == torch.float32:
        torch.testing.assert_close(y.double(), y0.double() + delta, atol=1e-4, rtol=1e-4)
    else:
        magnitude = y0.double().abs() + lora_magnitude(x, a, bt.transpose(1, 2), slots)
        assert_within_bf16_ulps(y, y0.double() + delta, magnitude, ulps=0.6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_build_gives_the_same_bits_with_any_thread_count(build: str, dtype: torch.dtype) -> None:
    """Threads split the work items by ranges and prefetch what they do next: the result must not
    depend on how many there are (long runs, one 2048-token segment)."""
    a, bt, ranks, offsets = _layer(dtype, seed=3)
    buffers = make_buffers(a, bt, offsets, ranks)
    slots = MIXES["long_runs"] + [3] * 2048
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=NUM_SLOTS)
    if mapping.segments.max_len > lora_cpu.max_segment_len(dtype):
        pytest.skip(f"the {build} build leaves {mapping.segments.max_len}-token {dtype} segments to torch")
    g = torch.Generator().manual_seed(4)
    x = torch.randn(len(slots), IN, generator=g).to(dtype)
    y0 = torch.randn(len(slots), offsets[-1], generator=g).to(dtype)
    threads = torch.get_num_threads()
    results = []
    try:
        for n in (1, 2, 3, 7):
            torch.set_num_threads(n)
            results.append(run_cpu_kernel(y0.clone(), x, buffers, mapping))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], other) for other in results[1:])
    assert not torch.equal(results[0], y0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("where", ["a", "bt"])
def test_every_build_keeps_a_nan_slot_to_its_tokens(build: str, where: str, dtype: torch.dtype) -> None:
    slots = MIXES["some_without"]
    a, bt, ranks, offsets = _layer(dtype, seed=3)
    x = torch.randn(len(slots), IN, generator=torch.Generator().manual_seed(4)).to(dtype)
    y0 = torch.randn(len(slots), offsets[-1], generator=torch.Generator().manual_seed(5)).to(dtype)
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=NUM_SLOTS)
    clean = run_cpu_kernel(y0.clone(), x, make_buffers(a, bt, offsets, ranks), mapping)
    (a if where == "a" else bt)[0, 0, 0] = float("nan")  # slot 0, inside its first slice's rank
    poisoned = run_cpu_kernel(y0.clone(), x, make_buffers(a, bt, offsets, ranks), mapping)
    mine = [i for i, s in enumerate(slots) if s == 0]
    others = [i for i, s in enumerate(slots) if s != 0]
    assert torch.equal(poisoned[others], clean[others])
    assert torch.isnan(poisoned[mine, : SIZES[0]]).any(dim=1).all()  # it does reach its own tokens
    assert torch.equal(poisoned[mine, SIZES[0] :], clean[mine, SIZES[0] :])  # and only its slice


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_every_build_writes_slots_as_torch_does(build: str, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """A scaled copy (fp32 multiply, one rounding), a transposed one and a zeroing, as BlockWriter
    batches them: the same bits as the torch writes it falls back to."""
    g = torch.Generator().manual_seed(6)
    src = torch.randn(5, 77, generator=g).to(dtype)
    src_t = torch.randn(131, 5, generator=g).to(dtype)  # written transposed into [5, 131] rows
    buffers = []
    for kernel in ("1", "0"):
        monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", kernel)
        dst = torch.randn(3, 12, 140, generator=torch.Generator().manual_seed(7)).to(dtype)
        writer = BlockWriter()
        writer.write(dst, 1, 2, 5, 3, 80, src, scale=0.37)
        writer.write(dst, 2, 0, 5, 4, 135, src_t, scale=1.7, transposed=True)
        writer.write(dst, 0, 6, 4, 0, 140, None)
        writer.flush()
        buffers.append(dst)
    assert torch.equal(buffers[0], buffers[1])
    expected = (src.float() * 0.37).to(dtype)
    assert torch.equal(buffers[0][1, 2:7, 3:80], expected) and not buffers[0][0, 6:10].any()
