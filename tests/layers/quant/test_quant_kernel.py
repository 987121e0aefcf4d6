"""The quantized linear kernel (quant_kernel.c) against the float64 dequantize-then-matmul reference, for
every format on every build this machine can run (AVX512-VNNI, AVX2, portable C) and every path (the
integer path's row streaming and its panels, the latter forced to every row count by the "avx2_panels"
build; the dequantized-tile path past `integer_rows`), and its torch twin.

Tolerances come from what each path rounds: the decode path quantizes activations to int8 per 32
values for Q8_0 / Q4_0 / Q4_1 and per 256 for the K-quants (error at most amax/254 per value, so a group
adds at most amax/254 * sum |w| of it), or float32 x to two int8 levels where the build is set to
(amax/32512 per value); the tile path rounds the weights to x's dtype; both sum in float32 and round
once to x's dtype."""

from __future__ import annotations

import platform
from typing import Any

import pytest
import torch
from support.quant_blocks import random_quant_tensor

from loraserve.layers.quant import kernel as qk
from loraserve.layers.quant.formats import PANEL_TYPES, QUANT_TYPES, QuantTensor, reference_linear
from loraserve.native.build import cpu_flags, load_library

# (rows, out): one row, 4-row groups with tails (3, 5, 17, 33), the last integer-path row count and the
# first tile-path one, 64 rows; outputs across the kernel's 16-row chunks with tails, multiples of 8
# (every format at one level takes panels of 8 rows) and not (the row layouts)
ROWS_OUT = [
    (1, 1),
    (3, 40),
    (5, 16),
    (16, 33),
    (17, 56),
    (qk.DECODE_ROWS, 19),
    (qk.DECODE_ROWS + 1, 24),
    (33, 18),
    (64, 8),
]
LAYOUT_OUT = pytest.mark.parametrize("out", [24, 29], ids=["panels", "rows"])  # rows: not a multiple of 8


def _in_features(name: str) -> list[int]:
    """K-quants take multiples of 256; the 32-blocks odd multiples of 32 too, and rows whose blocks end
    in a group of 8, a pair or one block (576: SmolLM2's width, 2 groups of 8 and a pair)."""
    return [256, 512] if QUANT_TYPES[name].block_size == 256 else [32, 96, 544, 576]


def _linear_by(
    lib: Any, x: torch.Tensor, weight: qk.QuantWeight, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """qk.linear by the build `lib`; the process's own build is restored after."""
    own = qk.kernel_library()
    qk.use_library(lib)
    try:
        return qk.linear(x, weight, bias)
    finally:
        qk.use_library(own)


def _bounds(
    x: torch.Tensor, tensor: QuantTensor, bias: torch.Tensor | None, levels: int = 1
) -> tuple[torch.Tensor, ...]:
    """(float64 reference, sum |x||w| (+|b|), the activations' quantization error bound per output:
    amax/254 per value of its group (32 values, 256 for the K-quants), amax/32512 for float32 x at two
    levels, plus float32 rounding of the residual)."""
    ref = reference_linear(x, tensor, bias)
    w = tensor.dequantize(torch.float64).abs()
    xd = x.double().abs()
    magnitude = xd @ w.T + (0 if bias is None else bias.double().abs())
    m, k = x.shape
    group = tensor.qtype.block_size  # 32, or a K-quant's 256: how the kernel quantizes x for it
    amax = xd.reshape(m, k // group, group).amax(-1)  # [m, groups]
    w_sums = w.reshape(w.shape[0], k // group, group).sum(-1)  # [n, groups]
    unit = 32000 if x.dtype == torch.float32 and levels == 2 else 254
    return ref, magnitude, (amax / unit) @ w_sums.T


def _check(
    y: torch.Tensor, x: torch.Tensor, tensor: QuantTensor, bias: torch.Tensor | None, levels: int = 1
) -> None:
    ref, magnitude, act = _bounds(x, tensor, bias, levels)
    bound = 2e-6 * magnitude  # float32 sums
    if x.shape[0] <= qk.integer_rows(qk.prepare(tensor, levels), x.dtype):
        bound = bound + act
    elif x.dtype == torch.bfloat16:
        bound = bound + 2.0**-9 * magnitude  # weights rounded to bf16 in the tile
    if y.dtype == torch.bfloat16:
        bound = bound + 2.0**-8 * (ref.abs() + bound)  # one rounding of the result
    error = (y.double() - ref).abs()
    worst = int(torch.argmax(error - bound))
    assert bool((error <= bound).all()), (
        f"error {error.flatten()[worst]:.4g} > bound {bound.flatten()[worst]:.4g}"
    )


@pytest.fixture(params=[1, 2], ids=["one level", "two levels"])
def levels(request: pytest.FixtureRequest) -> int:
    """float32 activations at one int8 level (the default) or two (LORASERVE_CPU_QUANT_ACT_LEVELS=2)."""
    return request.param


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_every_format_on_every_build_matches_reference(
    build: str, name: str, dtype: torch.dtype, levels: int
) -> None:
    if dtype == torch.bfloat16 and levels == 2:
        pytest.skip("bf16 activations take one level")
    qtype = QUANT_TYPES[name]
    g = torch.Generator().manual_seed(5)
    for i, (rows, out) in enumerate(ROWS_OUT):
        for k in _in_features(name):
            tensor = random_quant_tensor(qtype, out, k, seed=i * 7 + k)
            x = torch.randn(rows, k, generator=g).to(dtype)
            bias = torch.randn(out, generator=g).to(dtype) if i % 2 else None
            y = qk.linear(x, qk.prepare(tensor, act_levels=levels), bias)
            assert y.shape == (rows, out) and y.dtype == dtype
            _check(y, x, tensor, bias, levels)


@LAYOUT_OUT
@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_decode_path_is_exact_for_activations_int8_represents(build: str, name: str, out: int) -> None:
    """bf16 activations that are int8 times a power of two, amax 127 in every block, quantize without
    error: what is left is float32 summation and the result's rounding, so a wrong scale, min or nibble
    shows at once; float32 x on the same path is exact to float32 sums."""
    qtype = QUANT_TYPES[name]
    k = _in_features(name)[-1]
    g = torch.Generator().manual_seed(11)
    q = torch.randint(-127, 128, (3, k), generator=g).float()
    q.view(3, k // 32, 32)[:, :, 0] = 127.0
    x = (q * 2.0**-5).bfloat16()
    tensor = random_quant_tensor(qtype, out, k, seed=2)
    weight = qk.prepare(tensor)
    ref, magnitude, _ = _bounds(x, tensor, None)
    y = qk.linear(x, weight)
    assert bool(((y.double() - ref).abs() <= 2e-6 * magnitude + 2.0**-8 * ref.abs()).all())
    y32 = qk.linear(x.float(), weight)
    assert bool(((y32.double() - ref).abs() <= 2e-6 * magnitude + 1e-30).all())


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_float32_decode_path_is_exact_for_activations_two_int8_levels_represent(
    build: str, name: str
) -> None:
    """float32 activations (q + q2 / 256) * 2^-5 with |q| <= 126, |q2| <= 127 and one 127 (q2 = 0) per
    block quantize to exactly q and q2: the result is the reference to float32 sums, so a second level
    that is dropped, truncated, coarser or mis-signed shows at once."""
    qtype = QUANT_TYPES[name]
    k = _in_features(name)[-1]
    g = torch.Generator().manual_seed(12)
    q = torch.randint(-126, 127, (3, k), generator=g).double()
    q2 = torch.randint(-127, 128, (3, k), generator=g).double()
    q.view(3, k // 32, 32)[:, :, 0], q2.view(3, k // 32, 32)[:, :, 0] = 127.0, 0.0
    x = ((q + q2 / 256) * 2.0**-5).float()
    assert bool((x.double() == (q + q2 / 256) * 2.0**-5).all())  # float32 holds these values exactly
    tensor = random_quant_tensor(qtype, 29, k, seed=3)
    ref, magnitude, _ = _bounds(x, tensor, None, 2)
    y = qk.linear(x, qk.prepare(tensor, act_levels=2))
    assert bool(((y.double() - ref).abs() <= 2e-6 * magnitude + 1e-30).all())


@LAYOUT_OUT
@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_kernel_dequantize_matches_the_twin(build: str, name: str, out: int) -> None:
    tensor = random_quant_tensor(QUANT_TYPES[name], out, 512, seed=4)
    weight = qk.prepare(tensor)
    want = tensor.dequantize()
    got = qk.dequantize_rows(weight, torch.float32)
    assert torch.equal(got, want)  # s * q + add unfused, as the twin computes it
    torch.testing.assert_close(
        qk.dequantize_rows(weight, torch.bfloat16), want.bfloat16(), rtol=2.0**-7, atol=0
    )


def test_twin_without_a_build_and_leading_dims_and_out_slices() -> None:
    tensor = random_quant_tensor(QUANT_TYPES["Q4_K"], 24, 256, seed=6)
    weight = qk.prepare(tensor)
    x = torch.randn(2, 3, 256)
    y = qk.linear(x, weight)
    assert y.shape == (2, 3, 24)
    out = torch.zeros(6, 30)
    qk.linear(x.reshape(6, 256), weight, out=out[:, 4:28])
    assert torch.equal(out[:, 4:28], y.reshape(6, 24)) and not out[:, :4].any() and not out[:, 28:].any()
    own = qk.kernel_library()
    qk.use_library(None)
    try:
        assert qk.kernel_path() == "twin"
        twin = qk.linear(x.reshape(6, 256), weight)
    finally:
        qk.use_library(own)
    _check(twin, x.reshape(6, 256), tensor, None)


def test_bad_inputs_are_refused() -> None:
    weight = qk.prepare(random_quant_tensor(QUANT_TYPES["Q8_0"], 4, 64, seed=0))
    with pytest.raises(ValueError, match="64"):
        qk.linear(torch.randn(2, 32), weight)
    with pytest.raises(TypeError, match="float16"):
        qk.linear(torch.randn(2, 64).half(), weight)
    with pytest.raises(ValueError, match="panels or rows"):
        qk.prepare(random_quant_tensor(QUANT_TYPES["Q8_0"], 8, 64, seed=0), layout="tiles")


@pytest.mark.parametrize("name", ["Q4_1", "Q6_K"])
def test_integer_path_over_several_row_blocks(build: str, name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """More rows than the kernel's row blocks (64 rows; 256 on the panel path) and than DECODE_ROWS at
    two levels: every block's rows, the last one short, against the reference."""
    monkeypatch.setattr(qk, "DECODE_ROWS", 10**6)
    k = _in_features(name)[-1]
    tensor = random_quant_tensor(QUANT_TYPES[name], 37, k, seed=9)
    x = torch.randn(300, k, generator=torch.Generator().manual_seed(9))
    _check(qk.linear(x, qk.prepare(tensor)), x, tensor, None)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", sorted(PANEL_TYPES))
def test_panels_give_a_row_the_same_values_in_any_batch(build: str, name: str, dtype: torch.dtype) -> None:
    """Every format at one level sits in panels of 8 rows and takes one path at every row count, so
    a row's output is the same bits alone, in a speculative verification's few rows and in a prefill's
    many (greedy speculation's identity relies on it; the row layout's paths switch at PANEL_MIN_ROWS)."""
    k = _in_features(name)[-1]
    weight = qk.prepare(random_quant_tensor(QUANT_TYPES[name], 40, k, seed=21))
    assert weight.tensor.qtype == PANEL_TYPES[name]
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(21)).to(dtype)
    whole = qk.linear(x, weight)
    for lo, hi in ((0, 1), (69, 70), (3, 12), (5, 70)):
        assert torch.equal(qk.linear(x[lo:hi], weight), whole[lo:hi]), (lo, hi)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_panel_path_matches_row_streaming(name: str, dtype: torch.dtype) -> None:
    """The panels read x quantized as the row streaming reads it, so the two differ only in float32
    summation order: a scale, offset, min or quant packed into the wrong lane or block shows at once.
    Row counts around the 4-row passes and across a 16-row chunk's 8-row panels with a short one."""
    if platform.machine() not in ("x86_64", "AMD64") or not {"avx2", "fma"} <= cpu_flags():
        pytest.skip("the AVX2 builds")
    panels = qk.build_kernel(("-mno-avx512f", "-mno-avxvnni", "-DPANEL_MIN_ROWS=1"))
    rows = qk.build_kernel(("-mno-avx512f", "-mno-avxvnni", "-DPANEL_MIN_ROWS=1000000"))
    if panels is None or rows is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(13)
    for k in _in_features(name):
        weight = qk.prepare(random_quant_tensor(QUANT_TYPES[name], 21, k, seed=k))
        x = torch.randn(7, k, generator=g).to(dtype)
        bias = torch.randn(21, generator=g).to(dtype)
        got = _linear_by(panels, x, weight, bias).double()
        want = _linear_by(rows, x, weight, bias).double()
        scale = 2e-6 if dtype == torch.float32 else 2.0**-8
        assert bool(((got - want).abs() <= scale * (want.abs() + want.abs().amax())).all()), name


@pytest.mark.parametrize("arch", ["skylake-avx512", "icelake-server"])
def test_avx512_builds_compile(arch: str) -> None:
    """The AVX-512 paths (icelake-server: with VNNI's vpdpbusd) build here; this machine runs them only if
    it has the instructions (the `build` fixture then takes them)."""
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("x86 -march values")
    if qk.kernel_library() is None:
        pytest.skip("no C compiler")
    assert load_library("quant_kernel.c", arch=arch, extra_flags=("-ffp-contract=off",)) is not None


@pytest.mark.parametrize("name", sorted(PANEL_TYPES))
def test_panel_pairs_give_the_single_panels_bits(name: str) -> None:
    """AVX-512 VNNI builds run a chunk's two panels in 512-bit registers (quant_kernel_packed_pairs.h)
    with the same int32 sums and float steps per lane as one panel's 256-bit pass, which a chunk of one
    panel (40 rows: 16 + 16 + 8) and -DPACKED_NO_PAIRS still take: the outputs are equal bit for bit.
    The pairs run the passes after a chunk's first (5 rows: 4 streamed, then 1; 9: 4, then 4 and 1),
    and from 8 rows Q4_K's and Q5_K's first too (9 rows: all three passes; Q6_K's streams one row);
    Q5_K's and Q6_K's passes take up to 6 rows (5: Q6_K 1, then 4; Q5_K 4, then 1), and from 9 rows
    they read their chunk unpacked to bytes, 4 super-blocks at a time (quant_kernel_kbytes.h; 9 and 13
    rows, Q6_K in passes of up to 6, Q5_K of 4; 1280 inputs: a slab of 4 and one of 1)."""
    if not {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"} <= cpu_flags():
        pytest.skip("the pairs run on AVX-512 VNNI CPUs")
    pairs, single = qk.build_kernel(), qk.build_kernel(("-DPACKED_NO_PAIRS",))
    if pairs is None or single is None:
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(17)
    for k in _in_features(name) + ([1280] if QUANT_TYPES[name].block_size == 256 else []):
        weight = qk.prepare(random_quant_tensor(QUANT_TYPES[name], 40, k, seed=k))
        for rows in (1, 2, 3, 4, 5, 9, 13):
            x = torch.randn(rows, k, generator=g).to(torch.bfloat16)
            assert torch.equal(_linear_by(pairs, x, weight), _linear_by(single, x, weight)), (k, rows)
