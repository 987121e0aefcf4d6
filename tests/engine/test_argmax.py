"""argmax_rows against torch.argmax on float32 values: random rows, ties, NaNs, infinities, signed zeros,
widths with and without a tail, on every path (the C kernel's AVX-512 and portable builds, and torch)."""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import Any

import pytest
import torch

from loraserve.engine.argmax import (
    CHUNK,
    MIN_FAST_LEN,
    argmax_rows,
    build_kernel,
    kernel_argmax,
    torch_argmax,
)
from loraserve.native.build import cpu_flags

WIDTHS = [MIN_FAST_LEN, 49152, 50257, 32000 + 7, 100, 1, 15, 16, 17, 64, 65]


@cache
def _build(extra_flags: tuple[str, ...]) -> Any:
    kernel = build_kernel(extra_flags)
    if kernel is None:
        pytest.skip("no C compiler")
    return kernel


def _by_kernel(extra_flags: tuple[str, ...]) -> Callable[[torch.Tensor], torch.Tensor]:
    def run(x: torch.Tensor) -> torch.Tensor:
        out = kernel_argmax(_build(extra_flags), x)
        assert out is not None, "the kernel must serve 2-D CPU float32/bf16 rows of unit stride"
        return out
    return run


def _vector_build() -> Callable[[torch.Tensor], torch.Tensor]:
    if not {"avx512f", "avx512bw", "avx512vl"} <= cpu_flags():
        pytest.skip("this CPU has no AVX-512 (BW, VL): the native build is the portable one")
    return _by_kernel(())


PATHS: dict[str, Callable[[], Callable[[torch.Tensor], torch.Tensor]]] = {
    "avx512": _vector_build,
    "portable": lambda: _by_kernel(("-mno-avx512f",)),
    "torch": lambda: lambda x: torch_argmax(x.float() if x.dtype == torch.bfloat16 else x),
    "argmax_rows": lambda: argmax_rows,
}


def _expected(x: torch.Tensor) -> torch.Tensor:
    return x.float().argmax(dim=-1)


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", WIDTHS)
def test_matches_torch_on_random_rows(path: str, width: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(33, width, generator=g) * 4).to(dtype)  # bf16 rounding makes ties common
    assert torch.equal(PATHS[path]()(x), _expected(x))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [w for w in WIDTHS if w >= 2 * CHUNK + 6])
def test_ties_nans_and_infinities_resolve_as_torch_does(path: str, width: int, dtype: torch.dtype) -> None:
    x = torch.zeros(14, width)
    last = width - 1
    x[0, [5, last]] = 3.0  # a tie between the first piece and the tail: the first wins
    x[1, [last - 1, last]] = 3.0  # a tie inside the tail
    x[2, [CHUNK + 1, 7]] = 3.0  # a tie across pieces
    x[3, last] = float("nan")  # a NaN in the tail beats any number
    x[4, [9, last]] = float("nan")  # the first NaN wins
    x[5, 3] = float("inf")
    x[5, last] = float("nan")  # NaN beats inf
    x[6] = float("-inf")  # all equal: index 0
    x[7, last] = 1.0  # the maximum only in the tail
    x[8, :] = -1.0
    x[8, CHUNK * 2 + 5] = float("nan")
    x[9, width // 2] = float("inf")
    x[10, :] = -1.0
    x[10, [CHUNK + 3, 4]] = torch.tensor([0.0, -0.0])  # -0.0 equals +0.0: the first of them wins
    x[11, :] = -1.0
    x[11, [2, last]] = torch.tensor([-0.0, 0.0])
    x[12] = float("nan")  # every value a NaN: index 0
    x[13, :] = -5.0  # a negative maximum after the first vector of 16
    x[13, 17] = -2.0
    x = x.to(dtype)
    assert torch.equal(PATHS[path]()(x), _expected(x))


@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", [49152, 50257, 37])
def test_rows_inside_a_wider_tensor(path: str, width: int, dtype: torch.dtype) -> None:
    """Rows of unit stride whose row stride is not the width (a slice of wider logits): the values
    beside each row, larger than any inside it, must not be read."""
    g = torch.Generator().manual_seed(5)
    wide = torch.full((7, width + 40), 1e4).to(dtype)
    x = wide[:, 3 : 3 + width]
    x.copy_(torch.randn(7, width, generator=g).to(dtype))
    x[2, width - 1] = 50.0  # the maximum at the row's end
    x[4, 1] = float("nan")
    assert x.stride(0) != width and torch.equal(PATHS[path]()(x), _expected(x))


def test_kernel_declines_what_it_does_not_serve() -> None:
    kernel = _build(())
    assert kernel_argmax(kernel, torch.randn(8, 2 * MIN_FAST_LEN)[:, ::2]) is None  # rows without unit stride
    assert kernel_argmax(kernel, torch.randn(4, 100, dtype=torch.float64)) is None
    assert kernel_argmax(kernel, torch.randn(4, 0)) is None
    assert kernel_argmax(kernel, torch.randn(100)) is None


def test_other_shapes_and_dtypes_fall_back_to_torch() -> None:
    x = torch.randn(8, 2 * MIN_FAST_LEN)[:, ::2]  # rows without unit stride
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    y = torch.randn(5, 300, dtype=torch.float64)
    assert torch.equal(argmax_rows(y), y.argmax(dim=-1))
    assert torch.equal(argmax_rows(torch.empty(0, 49152)), torch.empty(0, dtype=torch.long))
    assert torch.equal(argmax_rows(torch.empty(0, 49152, dtype=torch.bfloat16)), torch.empty(0, dtype=torch.long))
