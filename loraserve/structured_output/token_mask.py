"""Grammar bitmasks -> the tokens a row may not take, and applying them: one masked operation over
the constrained rows of a step's logits.

A bitmask row holds one bit per token id (int32 words, bit i of word w is token 32 w + i, as
xgrammar writes them). `disallowed_tokens` unpacks it with numpy (single-threaded, so the mask
worker never starts a second OpenMP team beside the forward's), on the worker thread while the model
runs; `mask_rows` is then the engine thread's only work: a masked fill. Rows without a grammar are
not read or written.
"""

from __future__ import annotations

import numpy as np
import torch


def bitmask_words(vocab_size: int) -> int:
    return (vocab_size + 31) // 32


def disallowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[rows, words] int32 bitmask -> [rows, vocab_size] bool, True where the token is NOT allowed."""
    words = np.ascontiguousarray(bitmask.numpy()).astype("<i4", copy=False)
    bits = np.unpackbits(words.view(np.uint8), axis=1, bitorder="little")[:, :vocab_size]
    return torch.from_numpy(bits == 0)


def mask_rows(logits: torch.Tensor, disallowed: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[j], t] = -inf wherever disallowed[j, t]."""
    if not rows:
        return
    disallowed = disallowed.to(logits.device)
    if rows == list(range(logits.shape[0])):  # every row constrained, in order: no gather or scatter
        logits.masked_fill_(disallowed, float("-inf"))
        return
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logits[index] = logits[index].masked_fill_(disallowed, float("-inf"))


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """In place: logits[rows[j], t] = -inf wherever bit t of bitmask[j] is clear."""
    mask_rows(logits, disallowed_tokens(bitmask, logits.shape[1]), rows)
