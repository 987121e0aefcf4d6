"""The sampler's stage for vLLM's token controls: allowed_token_ids, bad words and logit_bias.

Applied as vLLM's sampler does, after the float32 copy and before min_tokens, the penalties and the
temperature: the allowed list first (everything else -inf), then bad words (-inf) and biases (added).
Rows without them are never read or written: the allowed lists keep their logits, fill their rows
with -inf (`index_fill_`) and put them back, and the bad words and biases of the whole batch are one
`index_put_(accumulate=True)` (a bad word adds -inf; biases are finite, so their order is moot).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from loraserve.sampling_params import SamplingParams
from loraserve.sampling_tokens import banned_after


class SamplingRow(Protocol):
    """What this stage reads of the sampler's row (`sampler.SamplingRow`)."""

    params: SamplingParams
    output_token_ids: list[int]


@dataclass(slots=True)
class ControlTensors:
    """One request's ids and biases as tensors, built on its first step and kept on its params
    (`SamplingParams.sampler_cache`): a long allowed list or bias map costs no per-step Python."""

    device: torch.device
    allowed: torch.Tensor | None  # [k] the allowed token ids
    bias_ids: torch.Tensor | None  # [m] the biased token ids
    bias_values: torch.Tensor | None  # [m] float32


def control_tensors(params: SamplingParams, device: torch.device) -> ControlTensors:
    cached = params.sampler_cache
    if isinstance(cached, ControlTensors) and cached.device == device:
        return cached
    bias = params.logit_bias
    built = ControlTensors(
        device,
        None if params.allowed_token_ids is None else torch.tensor(params.allowed_token_ids, device=device),
        torch.tensor(list(bias), dtype=torch.long, device=device) if bias else None,
        torch.tensor(list(bias.values()), dtype=torch.float32, device=device) if bias else None,
    )
    params.sampler_cache = built
    return built


def apply_token_controls(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Edit `logits` [len(rows), vocab] (float32) in place for the rows whose params ask for it."""
    _apply_allowed_token_ids(logits, rows)
    _apply_bad_words_and_bias(logits, rows)


def _row_ids(i: int, ids: torch.Tensor) -> torch.Tensor:
    return torch.full_like(ids, i)


def _apply_allowed_token_ids(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    """Keep the allowed logits, fill their rows with -inf, put them back: a row fill is cheaper than
    a vocabulary-sized mask, and rows without a list are not touched."""
    selected = [i for i, row in enumerate(rows) if row.params.allowed_token_ids is not None]
    if not selected:
        return
    device = logits.device
    allowed = [control_tensors(rows[i].params, device).allowed for i in selected]
    tokens = [ids for ids in allowed if ids is not None]
    index = (
        torch.cat([_row_ids(i, ids) for i, ids in zip(selected, tokens, strict=True)]),
        torch.cat(tokens),
    )
    kept = logits[index]
    logits.index_fill_(0, torch.tensor(selected, device=device), float("-inf"))
    logits[index] = kept


def _apply_bad_words_and_bias(logits: torch.Tensor, rows: Sequence[SamplingRow]) -> None:
    device = logits.device
    row_parts: list[torch.Tensor] = []
    token_parts: list[torch.Tensor] = []
    value_parts: list[torch.Tensor] = []
    banned_rows: list[int] = []
    banned_tokens: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        table = params.bad_words_table
        if table is not None:
            banned = list(banned_after(table, row.output_token_ids))
            banned_rows.extend([i] * len(banned))
            banned_tokens.extend(banned)
        if params.logit_bias:
            tensors = control_tensors(params, device)
            assert tensors.bias_ids is not None and tensors.bias_values is not None
            row_parts.append(_row_ids(i, tensors.bias_ids))
            token_parts.append(tensors.bias_ids)
            value_parts.append(tensors.bias_values)
    if banned_rows:
        row_parts.append(torch.tensor(banned_rows, device=device))
        token_parts.append(torch.tensor(banned_tokens, device=device))
        value_parts.append(torch.full((len(banned_rows),), float("-inf"), device=device))
    if not row_parts:
        return
    logits.index_put_(
        (torch.cat(row_parts), torch.cat(token_parts)),
        torch.cat(value_parts).to(logits.dtype),
        accumulate=True,
    )
