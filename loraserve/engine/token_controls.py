"""The sampler's stage for vLLM's token controls: allowed_token_ids, bad words and logit_bias.

Applied as vLLM's sampler does, after the float32 copy and before min_tokens, the penalties and the
temperature: the allowed list first (everything else -inf), then bad words (-inf) and biases (added).
Rows without them are never read or written: the allowed lists keep their logits, fill their rows
with -inf (`index_fill_`) and put them back, and the bad words and biases of the whole batch are one
`index_put_(accumulate=True)` (a bad word adds -inf; biases are finite, so their order is moot).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from loraserve.sampling_params import SamplingParams
from loraserve.sampling_tokens import banned_after


class SamplingRow(Protocol):
    """What this stage reads of the sampler's row (`sampler.SamplingRow`)."""

    params: SamplingParams
    output_token_ids: list[int]


def apply_token_controls(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Edit `logits` [len(rows), vocab] (float32) in place for the rows whose params ask for it."""
    _apply_allowed_token_ids(logits, rows)
    _apply_bad_words_and_bias(logits, rows)


def _apply_allowed_token_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Keep the allowed logits, fill their rows with -inf, put them back: a row fill is cheaper than
    a vocabulary-sized mask, and rows without a list are not touched."""
    selected = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not selected:
        return
    row_index: list[int] = []
    token_index: list[int] = []
    for i in selected:
        allowed = rows[i].params.allowed_token_ids or []
        row_index.extend([i] * len(allowed))
        token_index.extend(allowed)
    device = logits.device
    index = (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device))
    kept = logits[index]
    logits.index_fill_(0, torch.tensor(selected, device=device), float("-inf"))
    logits[index] = kept


def _apply_bad_words_and_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    row_index: list[int] = []
    token_index: list[int] = []
    values: list[float] = []
    for i, row in enumerate(rows):
        params = row.params
        table = params.bad_words_table
        if table is not None:
            banned = list(banned_after(table, row.output_token_ids))
            row_index.extend([i] * len(banned))
            token_index.extend(banned)
            values.extend([float("-inf")] * len(banned))
        if params.logit_bias:
            row_index.extend([i] * len(params.logit_bias))
            token_index.extend(params.logit_bias)
            values.extend(params.logit_bias.values())
    if not row_index:
        return
    device = logits.device
    logits.index_put_(
        (torch.tensor(row_index, device=device), torch.tensor(token_index, device=device)),
        torch.tensor(values, dtype=logits.dtype, device=device),
        accumulate=True,
    )
