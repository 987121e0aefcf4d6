"""Applying a step's grammar bitmasks to its logits: one masked operation over the constrained rows.

A bitmask row holds one bit per token id (int32 words, bit i of word w is token 32 w + i, as
xgrammar writes them); a cleared bit sets that token's logit to -inf. Rows without a grammar are not
read or written.
"""

from __future__ import annotations

import torch

_SHIFTS_CACHE: dict[torch.device, torch.Tensor] = {}


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bool, True where the token is allowed."""
    shifts = _SHIFTS_CACHE.get(bitmask.device)
    if shifts is None:
        shifts = _SHIFTS_CACHE.setdefault(
            bitmask.device, torch.arange(32, dtype=torch.int32, device=bitmask.device)
        )
    bits = (bitmask.unsqueeze(-1) >> shifts).bitwise_and_(1)
    return bits.view(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[j], t] = -inf wherever bit t of bitmask[j] is clear.

    On CPU xgrammar's kernel does it (one call over the batch, ~4-8x faster than the torch ops at a
    49k vocabulary, same result); elsewhere `apply_token_bitmask_torch`."""
    if not rows:
        return
    if logits.device.type == "cpu" and logits.dtype in (torch.float32, torch.bfloat16, torch.float16):
        import xgrammar as xgr

        full = bitmask.new_full((logits.shape[0], bitmask.shape[1]), -1)  # -1: every token allowed
        full[rows] = bitmask
        xgr.apply_token_bitmask_inplace(logits, full, vocab_size=logits.shape[1], indices=rows)
        return
    apply_token_bitmask_torch(logits, bitmask, rows)


def apply_token_bitmask_torch(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """The torch twin of `apply_token_bitmask` (any device)."""
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    allowed = allowed_tokens(bitmask.to(logits.device), logits.shape[1])
    logits[index] = logits[index].masked_fill_(~allowed, float("-inf"))
