"""Mask application, bitwise against a reference that sets -inf on each disallowed id, row by row."""

from __future__ import annotations

import pytest
import torch

from loraserve.structured_output.token_mask import (
    apply_token_bitmask,
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


@pytest.mark.parametrize("rows", [[3, 0], [0, 1, 2, 3, 4]])  # out of order with free rows; every row
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_masks_only_the_constrained_rows_bitwise(rows: list[int], dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    vocab = 100  # not a multiple of 32: the last word is partly padding
    logits = torch.randn(5, vocab).to(dtype)
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), bitmask_words(vocab)), dtype=torch.int32)
    expected = _reference(logits, bitmask, rows)
    got = logits.clone()
    apply_token_bitmask(got, bitmask, rows)
    assert torch.equal(got, expected)
    for free in set(range(5)) - set(rows):
        assert torch.equal(got[free], logits[free])
