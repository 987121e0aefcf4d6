"""The fused elementwise ops (RMSNorm with residual, SiLU-and-mul, rope): C kernel vs torch twin vs a
float64 reference, in float32 and bfloat16, on strided rows like the ones the model hands them."""

from __future__ import annotations

import platform
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

from loraserve.layers import fused_cpu
from loraserve.native.build import cpu_flags
from loraserve.native.kernel_slot import KernelSlot

DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16: a couple of ulps at 2^-8 relative; float32: summation order and the exp approximation.
    return {"atol": 3e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


@dataclass(frozen=True)
class Ops:
    rms_norm: Callable[..., tuple[torch.Tensor, torch.Tensor | None]]
    silu_and_mul: Callable[[torch.Tensor], torch.Tensor]
    rotary_: Callable[..., None]


# the builds of other CPU classes this CPU can run: -march= values and the CPU flags they need
OTHER_BUILDS = {"avx2": ("haswell", {"avx2", "fma"}), "portable": ("x86-64", set())}


@pytest.fixture(params=["kernel", "avx2", "portable", "twin"])
def ops(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Ops:
    """The twin, this CPU's build, and the AVX2 and portable builds (what other CPUs run)."""
    if request.param == "twin":
        return Ops(fused_cpu.rms_norm_twin, fused_cpu.silu_and_mul_twin, fused_cpu.rotary_twin_)
    if request.param in OTHER_BUILDS:
        arch, needs = OTHER_BUILDS[request.param]
        if platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags():
            pytest.skip(f"-march={arch} needs an x86-64 CPU with {sorted(needs)}")
        monkeypatch.setattr(fused_cpu, "_kernel", KernelSlot.holding(fused_cpu.build_kernel(arch)))
    if not fused_cpu.kernel_available():
        pytest.skip("no C compiler: the fused kernel cannot be built here")
    return Ops(fused_cpu.rms_norm, fused_cpu.silu_and_mul, fused_cpu.rotary_)


def wide_rows(rows: int, width: int, dtype: torch.dtype, pad: int = 7, seed: int = 0) -> torch.Tensor:
    """[rows, width] rows inside a wider buffer: a row stride that is not the width."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width + pad, generator=g) * 2).to(dtype)[:, :width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (5, 576), (33, 100)])
def test_rms_norm_matches_float64(ops: Ops, dtype: torch.dtype, rows: int, width: int) -> None:
    x = wide_rows(rows, width, dtype)
    weight = (torch.rand(width, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    out, residual = ops.rms_norm(x, weight, 1e-6)
    assert residual is None and out.shape == x.shape and out.dtype == dtype
    h = x.double()
    ref = weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_in_place(ops: Ops, dtype: torch.dtype) -> None:
    x, residual = wide_rows(9, 576, dtype, seed=2), wide_rows(9, 576, dtype, pad=0, seed=3).contiguous()
    before = residual.clone()
    weight = torch.ones(576, dtype=dtype)
    out, updated = ops.rms_norm(x, weight, 1e-5, residual)
    assert updated is residual
    torch.testing.assert_close(residual, (before + x), atol=0, rtol=0)  # the add rounds like torch's
    h = before.double() + x.double()
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out.double(), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1536), (17, 100), (200, 384)])
def test_silu_and_mul_matches_float64(ops: Ops, dtype: torch.dtype, rows: int, width: int) -> None:
    x = wide_rows(rows, 2 * width, dtype) * 4  # reach exp's tails: |x| up to ~30
    out = ops.silu_and_mul(x)
    assert out.shape == (rows, width) and out.dtype == dtype
    gate, up = x.double().split(width, dim=-1)
    torch.testing.assert_close(out.double(), torch.nn.functional.silu(gate) * up, **tol(dtype))


def test_silu_and_mul_extremes_and_nan(ops: Ops) -> None:
    gate = torch.tensor([-100.0, 100.0, 0.0, float("nan"), 2.0, -3.0, 30.0, -30.0]).repeat(
        5
    )  # lanes and tail
    out = ops.silu_and_mul(torch.cat([gate, torch.full_like(gate, 2.0)]).unsqueeze(0))[0]
    for i in (0, 8, 32):
        assert out[i].abs() < 1e-30 and out[i + 1] == pytest.approx(200.0) and out[i + 2] == 0.0
        assert torch.isnan(out[i + 3])
        torch.testing.assert_close(out[i + 4 : i + 8], out[4:8], atol=1e-6, rtol=1e-6)  # lanes = scalar tail
    expected = 2.0 * torch.nn.functional.silu(gate[4:8].double())
    torch.testing.assert_close(out[4:8].double(), expected, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,head_dim", [(9, 64), (2, 128), (3, 6)])
def test_rotary_in_place_matches_float64(ops: Ops, dtype: torch.dtype, num_heads: int, head_dim: int) -> None:
    rows, extra = 11, 2 * head_dim  # heads past num_heads (v) must stay untouched
    x = wide_rows(rows, num_heads * head_dim + extra, dtype)
    before = x.clone()
    positions = torch.randint(0, 500, (rows,), generator=torch.Generator().manual_seed(4))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = torch.outer(torch.arange(512).double(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    ops.rotary_(x, positions, cos.float(), sin.float(), num_heads, head_dim)
    torch.testing.assert_close(
        x[:, num_heads * head_dim :], before[:, num_heads * head_dim :], atol=0, rtol=0
    )
    heads = before[:, : num_heads * head_dim].double().unflatten(-1, (num_heads, head_dim))
    half = head_dim // 2
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    rotated = torch.cat([-heads[..., half:], heads[..., :half]], dim=-1)
    ref = (heads * c + rotated * s).flatten(1)
    torch.testing.assert_close(x[:, : num_heads * head_dim].double(), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_and_twin_agree_on_bf16_rounding(dtype: torch.dtype) -> None:
    """The kernel rounds where the twin's torch ops round: outputs agree to within one ulp."""
    if not fused_cpu.kernel_available():
        pytest.skip("no C compiler: the fused kernel cannot be built here")
    x = wide_rows(32, 3072, dtype, seed=5)
    weight = (torch.rand(3072, generator=torch.Generator().manual_seed(6)) + 0.5).to(dtype)
    kernel_silu = fused_cpu.silu_and_mul(x)
    kernel_norm = fused_cpu.rms_norm(x, weight, 1e-6)[0]
    twin_silu, twin_norm = fused_cpu.silu_and_mul_twin(x), fused_cpu.rms_norm_twin(x, weight, 1e-6)[0]
    ulp = 2.0**-7 if dtype == torch.bfloat16 else 2.0**-17  # float32: sum order over 3072 values
    for a, b in ((kernel_silu, twin_silu), (kernel_norm, twin_norm)):
        diff = (a.double() - b.double()).abs()
        assert bool((diff <= b.double().abs() * ulp + 1e-30).all()), float(diff.max())


def test_rotary_positions_outside_the_tables_are_refused(ops: Ops) -> None:
    x = wide_rows(3, 2 * 8, torch.float32)
    table = torch.zeros(16, 8)
    with pytest.raises(IndexError):
        ops.rotary_(x, torch.tensor([0, 5, 16]), table, table, 2, 8)
