"""Gemma's fused ops (the (1 + w) RMSNorm in its three modes, GeGLU): C kernel and torch twin against a
float64 reference, in float32 and bfloat16, on strided rows and widths that are not a vector multiple."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from loraserve.layers import fused_cpu
from loraserve.layers.fused_cpu import ADD_THEN_NORM, NORM_ONLY, NORM_THEN_ADD

DTYPES = [torch.float32, torch.bfloat16]
MODES = [NORM_ONLY, ADD_THEN_NORM, NORM_THEN_ADD]


def tol(dtype: torch.dtype) -> dict[str, float]:
    # bf16: a couple of ulps at 2^-8 relative (each rounding the twin makes); float32: summation order, exp.
    return {"atol": 3e-2, "rtol": 2e-2} if dtype == torch.bfloat16 else {"atol": 2e-5, "rtol": 2e-5}


@pytest.fixture(params=["kernel", "twin"])
def impl(request: pytest.FixtureRequest) -> str:
    if request.param == "kernel" and not fused_cpu.kernel_available():
        pytest.skip("no C compiler: the fused kernel cannot be built here")
    return str(request.param)


def _norm(impl: str) -> Callable[..., torch.Tensor]:
    return fused_cpu.offset_rms_norm if impl == "kernel" else fused_cpu.offset_rms_norm_twin


def _reference(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.double()
    return h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + w.double())


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("width", [7, 64, 1152 + 3])
def test_offset_rms_norm_matches_float64(impl: str, dtype: torch.dtype, mode: int, width: int) -> None:
    g = torch.Generator().manual_seed(width + mode)
    wide = torch.randn(5, width + 9, generator=g).to(dtype)
    x = wide[:, 4 : 4 + width]  # strided rows, as the model's column slices are
    weight = torch.randn(width, generator=g).to(dtype)
    residual = torch.randn(5, width, generator=g).to(dtype)
    before = residual.clone()
    out = _norm(impl)(x, 1.0 + weight.float(), 1e-6, residual if mode != NORM_ONLY else None, mode)
    if mode == NORM_ONLY:
        torch.testing.assert_close(out.double(), _reference(x, weight, 1e-6), **tol(dtype))
    elif mode == ADD_THEN_NORM:
        torch.testing.assert_close(residual.double(), x.double() + before.double(), **tol(dtype))
        torch.testing.assert_close(out.double(), _reference(residual, weight, 1e-6), **tol(dtype))
    else:
        assert out.data_ptr() == residual.data_ptr()  # the sum is written into the residual
        torch.testing.assert_close(
            residual.double(), before.double() + _reference(x, weight, 1e-6), **tol(dtype)
        )


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_offset_rms_norm_kernel_rounds_once_like_the_twin(dtype: torch.dtype) -> None:
    """The kernel's one rounding at the end is the twin's: bitwise equal outputs for the plain norm
    (no residual sum whose order differs)."""
    if not fused_cpu.kernel_available():
        pytest.skip("no C compiler")
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(9, 300, generator=g) * 4).to(dtype)
    scale = 1.0 + torch.randn(300, generator=g).to(dtype).float()
    kernel = fused_cpu.offset_rms_norm(x, scale, 1e-6)
    twin = fused_cpu.offset_rms_norm_twin(x, scale, 1e-6)
    assert (kernel.float() - twin.float()).abs().max() <= (2e-6 if dtype == torch.float32 else 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("width", [5, 96, 6912 + 1])
def test_gelu_tanh_and_mul_matches_float64(impl: str, dtype: torch.dtype, width: int) -> None:
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(4, 2 * width, generator=g) * 3).to(dtype)
    fn = fused_cpu.gelu_tanh_and_mul if impl == "kernel" else fused_cpu.gelu_tanh_and_mul_twin
    gate, up = x.double().split(width, dim=-1)
    expected = torch.nn.functional.gelu(gate, approximate="tanh") * up
    torch.testing.assert_close(fn(x).double(), expected, **tol(dtype))


def test_gelu_tanh_and_mul_extremes(impl: str) -> None:
    """Large gates saturate to the gate itself and to 0, without inf or nan; tiny ones keep their sign."""
    gate = torch.tensor([[-200.0, -30.0, -1e-6, 0.0, 1e-6, 30.0, 200.0]])
    x = torch.cat([gate, torch.ones_like(gate)], dim=-1)
    fn = fused_cpu.gelu_tanh_and_mul if impl == "kernel" else fused_cpu.gelu_tanh_and_mul_twin
    out = fn(x)
    assert torch.isfinite(out).all()
    torch.testing.assert_close(
        out, torch.tensor([[0.0, 0.0, -5e-7, 0.0, 5e-7, 30.0, 200.0]]), atol=1e-9, rtol=1e-5
    )
