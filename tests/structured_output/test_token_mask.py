"""Mask application, bitwise against a reference that sets -inf on each disallowed id, row by row."""

from __future__ import annotations

import pytest
import torch

from loraserve.structured_output.token_mask import (
    apply_token_bitmask,
    apply_token_bitmask_torch,
    bitmask_words,
)


def _reference(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    out = logits.clone()
    for j, row in enumerate(rows):
        for token in range(logits.shape[1]):
            word, bit = divmod(token, 32)
            if not (int(bitmask[j, word]) >> bit) & 1:
                out[row, token] = float("-inf")
    return out


@pytest.mark.parametrize("apply", [apply_token_bitmask, apply_token_bitmask_torch])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_only_the_constrained_rows_bitwise(apply, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(5, vocab).to(dtype)
    rows = [3, 0]  # out of order, rows 1, 2 and 4 unconstrained
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), bitmask_words(vocab)), dtype=torch.int32)
    expected = _reference(logits, bitmask, rows)
    got = logits.clone()
    apply(got, bitmask, rows)
    assert torch.equal(got, expected)
    for free in (1, 2, 4):
        assert torch.equal(got[free], logits[free])
