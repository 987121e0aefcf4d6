"""argmax_rows against torch.argmax: random rows, ties, NaNs, infinities, widths with and without a tail."""

from __future__ import annotations

import pytest
import torch

from loraserve.engine.argmax import CHUNK, MIN_FAST_LEN, argmax_rows

WIDTHS = [MIN_FAST_LEN, 49152, 50257, 32000 + 7, 100]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("width", WIDTHS)
def test_matches_torch_on_random_rows(width: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(width)
    x = (torch.randn(33, width, generator=g) * 4).to(dtype)  # bf16 rounding makes ties common
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("width", WIDTHS[:-1])
def test_ties_nans_and_infinities_resolve_as_torch_does(width: int) -> None:
    x = torch.zeros(10, width)
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
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))


@pytest.mark.parametrize("width", [49152, 50257])
def test_rows_inside_a_wider_tensor(width: int) -> None:
    """Rows of unit stride whose row stride is not the width (a slice of wider logits) take the fast path."""
    g = torch.Generator().manual_seed(5)
    wide = torch.randn(7, width + 40, generator=g)
    x = wide[:, 3 : 3 + width]
    x[2, width - 1] = 50.0  # the tail's maximum
    x[4, 1] = float("nan")
    assert x.stride(0) != width and torch.equal(argmax_rows(x), x.argmax(dim=-1))


def test_strided_rows_and_other_shapes_fall_back() -> None:
    x = torch.randn(8, 2 * MIN_FAST_LEN)[:, ::2]  # rows without unit stride
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    assert torch.equal(argmax_rows(torch.empty(0, 49152)), torch.empty(0, dtype=torch.long))
