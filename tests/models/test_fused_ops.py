"""The fused elementwise ops (RMSNorm with residual, SiLU-and-mul, rope): C kernel vs torch twin vs a
float64 reference, in float32 and bfloat16, on strided rows like the ones the model hands them."""

from __future__ import annotations

import pytest
import torch

from loraserve.layers import fused_ops

DTYPES = [torch.float32, torch.bfloat16]


def tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16: a couple of ulps at 2^-8 relative; float32: summation order and the exp approximation.
    return {"atol": 3e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 1e-5, "rtol": 1e-5}


@pytest.fixture(params=["kernel", "twin"])
def backend(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    if request.param == "kernel" and not fused_ops.kernel_available():
        pytest.skip("no C compiler: the fused kernel cannot be built here")
    if request.param == "twin":
        monkeypatch.setenv("LORASERVE_CPU_FUSED_OPS", "0")
    return str(request.param)


def wide_rows(rows: int, width: int, dtype: torch.dtype, pad: int = 7, seed: int = 0) -> torch.Tensor:
    """[rows, width] rows inside a wider buffer: a row stride that is not the width."""
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, width + pad, generator=g) * 2).to(dtype)[:, :width]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 64), (5, 576), (33, 100)])
def test_rms_norm_matches_float64(backend: str, dtype: torch.dtype, rows: int, width: int) -> None:
    x = wide_rows(rows, width, dtype)
    weight = (torch.rand(width, generator=torch.Generator().manual_seed(1)) + 0.5).to(dtype)
    out, residual = fused_ops.rms_norm(x, weight, 1e-6)
    assert residual is None and out.shape == x.shape and out.dtype == dtype
    h = x.double()
    ref = weight.double() * h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)
    torch.testing.assert_close(out.double(), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_adds_the_residual_in_place(backend: str, dtype: torch.dtype) -> None:
    x, residual = wide_rows(9, 576, dtype, seed=2), wide_rows(9, 576, dtype, pad=0, seed=3).contiguous()
    before = residual.clone()
    weight = torch.ones(576, dtype=dtype)
    out, updated = fused_ops.rms_norm(x, weight, 1e-5, residual)
    assert updated is residual
    torch.testing.assert_close(residual, (before + x), atol=0, rtol=0)  # the add rounds like torch's
    h = (before.double() + x.double())
    ref = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-5)
    torch.testing.assert_close(out.double(), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,width", [(1, 1536), (17, 100), (200, 384)])
def test_silu_and_mul_matches_float64(backend: str, dtype: torch.dtype, rows: int, width: int) -> None:
    x = wide_rows(rows, 2 * width, dtype) * 4  # reach exp's tails: |x| up to ~30
    out = fused_ops.silu_and_mul(x)
    assert out.shape == (rows, width) and out.dtype == dtype
    gate, up = x.double().split(width, dim=-1)
    torch.testing.assert_close(out.double(), torch.nn.functional.silu(gate) * up, **tol(dtype))


def test_silu_and_mul_extremes_and_nan(backend: str) -> None:
    x = torch.tensor([[-100.0, 100.0, 0.0, float("nan"), 2.0, 2.0, 3.0, 1.0]])
    out = fused_ops.silu_and_mul(x)
    assert out[0, 0].abs() < 1e-30 and out[0, 1] == pytest.approx(200.0) and out[0, 2] == 0.0
    assert torch.isnan(out[0, 3])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_heads,head_dim", [(9, 64), (2, 128), (3, 6)])
def test_rotary_in_place_matches_float64(backend: str, dtype: torch.dtype, num_heads: int, head_dim: int) -> None:
    rows, extra = 11, 2 * head_dim  # heads past num_heads (v) must stay untouched
    x = wide_rows(rows, num_heads * head_dim + extra, dtype)
    before = x.clone()
    positions = torch.randint(0, 500, (rows,), generator=torch.Generator().manual_seed(4))
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    freqs = torch.outer(torch.arange(512).double(), inv_freq)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()
    fused_ops.rotary_(x, positions, cos.float(), sin.float(), num_heads, head_dim)
    torch.testing.assert_close(x[:, num_heads * head_dim:], before[:, num_heads * head_dim:], atol=0, rtol=0)
    heads = before[:, : num_heads * head_dim].double().unflatten(-1, (num_heads, head_dim))
    half = head_dim // 2
    c, s = cos[positions].unsqueeze(1), sin[positions].unsqueeze(1)
    rotated = torch.cat([-heads[..., half:], heads[..., :half]], dim=-1)
    ref = (heads * c + rotated * s).flatten(1)
    torch.testing.assert_close(x[:, : num_heads * head_dim].double(), ref, **tol(dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_kernel_and_twin_agree_on_bf16_rounding(dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel rounds where the twin's torch ops round: outputs agree to within one ulp."""
    if not fused_ops.kernel_available():
        pytest.skip("no C compiler: the fused kernel cannot be built here")
    x = wide_rows(32, 3072, dtype, seed=5)
    weight = (torch.rand(3072, generator=torch.Generator().manual_seed(6)) + 0.5).to(dtype)
    kernel_silu = fused_ops.silu_and_mul(x)
    kernel_norm = fused_ops.rms_norm(x, weight, 1e-6)[0]
    twin_silu, twin_norm = fused_ops.silu_and_mul_twin(x), fused_ops.rms_norm_twin(x, weight, 1e-6)[0]
    ulp = 2.0 ** -7 if dtype == torch.bfloat16 else 2.0 ** -17  # float32: sum order over 3072 values
    for a, b in ((kernel_silu, twin_silu), (kernel_norm, twin_norm)):
        diff = (a.double() - b.double()).abs()
        assert bool((diff <= b.double().abs() * ulp + 1e-30).all()), float(diff.max())
