"""Turns one step's logits into next tokens: token controls, min_tokens, penalties, temperature,
top-k/top-p/min-p, logprobs.

Every stage is vectorised over the rows that need it; the only per-row Python is building index lists
and drawing noise from a seeded row's own generator. Sampling is the exponential race
(argmax of probs / Exponential(1)), which is an exact draw from `probs` and lets a seeded row consume
exactly one vocabulary-sized draw from its generator per step, whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import torch

from loraserve.engine.argmax import argmax_rows
from loraserve.engine.token_controls import apply_token_controls
from loraserve.outputs import Logprob
from loraserve.sampling_params import SamplingParams

# Rows of prompt logits turned into log-probabilities at once, to bound the extra memory.
_PROMPT_LOGPROBS_CHUNK_ELEMS = 1 << 26
# Most likely tokens searched for the top-p cut before falling back to a full sort of the row.
_TOP_P_CANDIDATES = 256


@dataclass(slots=True)
class SamplingRow:
    """One row of logits: the sequence it belongs to and how to sample its next token."""

    params: SamplingParams
    prompt_token_ids: list[int]
    output_token_ids: list[int]
    generator: torch.Generator | None  # the sequence's own generator; required when params.seed is set
    eos_token_id: int | None
    # This row's Exponential(1) draw, made beforehand (speculative decoding's rows: `DraftRound.noise`);
    # None: the sampler draws it (from `generator` when seeded).
    noise: torch.Tensor | None = None


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    # raw (un-penalised, un-biased, un-tempered: vLLM's default logprobs mode) logprob of each sampled
    # token; None where params.logprobs is None
    logprobs: list[float | None]
    top_logprobs: list[dict[int, Logprob] | None]  # None for rows whose params.logprobs is None


def create_generator(seed: int, device: torch.device | str) -> torch.Generator:
    """The per-sequence generator the engine keeps for a seeded request."""
    generator = torch.Generator(device=device)
    generator.manual_seed(seed)
    return generator


class Sampler:
    """Samples one token per row. Stateless: seeded state lives in each row's generator."""

    def __call__(self, logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
        if logits.dim() != 2 or logits.shape[0] != len(rows):
            raise ValueError(
                f"logits must be [num_rows={len(rows)}, vocab], got shape {tuple(logits.shape)}."
            )
        logprob_rows = [i for i, row in enumerate(rows) if row.params.logprobs is not None]
        if not logprob_rows and all(row.params.is_greedy for row in rows):
            return _greedy(logits, rows)
        edits = any(_needs_logit_edits(row) for row in rows)
        raw = logits.float()
        # Only the rows that asked for logprobs pay for a log_softmax over the vocabulary (the
        # sampled token's logprob feeds nothing else); taken before sampling edits `raw` in place.
        index = torch.tensor(logprob_rows, dtype=torch.long, device=logits.device) if logprob_rows else None
        every = index is not None and len(logprob_rows) == len(rows)
        raw_logprobs = torch.log_softmax(raw if every else raw[index], dim=-1) if index is not None else None
        if edits:
            # Penalties and masks below work in place; the caller's tensor stays intact (one copy
            # when the float32 conversion did not already make one). vLLM's order: allowed tokens,
            # bad words, min_tokens and logit_bias, then the penalties; logprobs are taken before.
            logits = raw.clone() if raw is logits else raw
            apply_token_controls(logits, rows)
            apply_min_tokens(logits, rows)
            apply_penalties(logits, rows)
        else:
            logits = raw
        sampled = _sample(logits, rows)

        sampled_logprobs: list[float | None] = [None] * len(rows)
        top_logprobs: list[dict[int, Logprob] | None] = [None] * len(rows)
        if index is not None and raw_logprobs is not None:
            picked = sampled[index]
            values = raw_logprobs.gather(1, picked.unsqueeze(1)).squeeze(1).tolist()
            dicts = _position_logprobs(
                raw_logprobs, picked, [rows[i].params.logprobs or 0 for i in logprob_rows]
            )
            for i, value, entry in zip(logprob_rows, values, dicts, strict=True):
                sampled_logprobs[i], top_logprobs[i] = value, entry
        return SamplerOutput(token_ids=sampled.tolist(), logprobs=sampled_logprobs, top_logprobs=top_logprobs)


def _greedy(logits: torch.Tensor, rows: list[SamplingRow]) -> SamplerOutput:
    """Greedy rows without logprobs: argmax_rows reads bf16 logits as they are, and only the rows
    whose logits are edited (token controls, min_tokens, penalties) get a float32 copy, edited in
    vLLM's order and argmaxed again."""
    sampled = argmax_rows(logits)
    edited = [i for i, row in enumerate(rows) if _needs_logit_edits(row)]
    if edited:
        index = torch.tensor(edited, device=logits.device)
        sub_rows = [rows[i] for i in edited]
        sub = logits[index].float()  # a copy even for float32: the caller's tensor stays intact
        apply_token_controls(sub, sub_rows)
        apply_min_tokens(sub, sub_rows)
        apply_penalties(sub, sub_rows)
        sampled[index] = argmax_rows(sub)
    none: list[Any] = [None] * len(rows)
    return SamplerOutput(token_ids=sampled.tolist(), logprobs=none, top_logprobs=list(none))


def _needs_logit_edits(row: SamplingRow) -> bool:
    params = row.params
    masks_stops = params.min_tokens > len(row.output_token_ids)
    return masks_stops or params.has_penalties or params.has_token_controls


def compute_prompt_logprobs(
    logits: torch.Tensor, target_ids: list[int], num_logprobs: int
) -> list[dict[int, Logprob]]:
    """Logprob and rank of each prompt token plus the top `num_logprobs` alternatives.

    Row i of `logits` is the distribution that predicted `target_ids[i]` (the caller shifts by one and
    reports None for the first prompt position, which nothing predicts).
    """
    if logits.dim() != 2 or logits.shape[0] != len(target_ids):
        raise ValueError(
            f"logits must be [len(target_ids)={len(target_ids)}, vocab], got shape {tuple(logits.shape)}."
        )
    if num_logprobs < 0:
        raise ValueError(f"num_logprobs must be non-negative, got {num_logprobs}.")
    chunk = max(1, _PROMPT_LOGPROBS_CHUNK_ELEMS // max(1, logits.shape[1]))
    targets = torch.tensor(target_ids, dtype=torch.long, device=logits.device)
    result: list[dict[int, Logprob]] = []
    for start in range(0, len(target_ids), chunk):
        logprobs = torch.log_softmax(logits[start : start + chunk].float(), dim=-1)
        stop = start + logprobs.shape[0]
        result.extend(_position_logprobs(logprobs, targets[start:stop], [num_logprobs] * (stop - start)))
    return result


def _position_logprobs(
    logprobs: torch.Tensor, token_ids: torch.Tensor, num_top: list[int]
) -> list[dict[int, Logprob]]:
    """Per row: the chosen token first, then the top-k tokens; rank = 1 + #tokens with a higher logprob."""
    chosen = logprobs.gather(1, token_ids.unsqueeze(1))
    ranks = (logprobs > chosen).sum(dim=-1) + 1
    max_top = min(max(num_top, default=0), logprobs.shape[1])
    top_ids_list: list[list[int]] = [[] for _ in num_top]
    top_vals_list: list[list[float]] = [[] for _ in num_top]
    top_ranks_list: list[list[int]] = [[] for _ in num_top]
    if max_top > 0:
        top_vals, top_ids = logprobs.topk(max_top, dim=-1)
        # Ties make the i-th best token's rank smaller than i + 1; counting strictly higher values keeps
        # the same definition as for the chosen token. All such values are themselves in the top-k,
        # which is sorted: the count is where the value first appears (a binary search per entry, in
        # memory linear in k; comparing every pair took k x k, 67 GB at k = 49,152 per position).
        descending = -top_vals
        top_ranks = torch.searchsorted(descending, descending, side="left") + 1
        top_ids_list, top_vals_list, top_ranks_list = top_ids.tolist(), top_vals.tolist(), top_ranks.tolist()
    result = []
    for row, (token_id, value, rank) in enumerate(
        zip(token_ids.tolist(), chosen.squeeze(1).tolist(), ranks.tolist(), strict=True)
    ):
        entry = {token_id: Logprob(logprob=value, rank=rank)}
        for j in range(min(num_top[row], max_top)):
            top_id = top_ids_list[row][j]
            if top_id not in entry:
                entry[top_id] = Logprob(logprob=top_vals_list[row][j], rank=top_ranks_list[row][j])
        result.append(entry)
    return result


def apply_min_tokens(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Forbid the tokens that would end a sequence before it has min_tokens output tokens."""
    vocab_size = logits.shape[1]
    row_index: list[int] = []
    token_index: list[int] = []
    for i, row in enumerate(rows):
        params = row.params
        if len(row.output_token_ids) >= params.min_tokens:
            continue
        # With ignore_eos, EOS cannot end the sequence, so (as in vLLM) it need not be masked.
        banned = list(params.stop_token_ids or [])
        if row.eos_token_id is not None and not params.ignore_eos:
            banned.append(row.eos_token_id)
        banned = [t for t in banned if t < vocab_size]
        row_index.extend([i] * len(banned))
        token_index.extend(banned)
    if row_index:
        index = torch.tensor([row_index, token_index], dtype=torch.long, device=logits.device)
        logits[index[0], index[1]] = float("-inf")


def apply_penalties(logits: torch.Tensor, rows: list[SamplingRow]) -> None:
    """Repetition (prompt + output), frequency and presence (output) penalties, as vLLM applies them."""
    penalised = [i for i, row in enumerate(rows) if row.params.has_penalties]
    if not penalised:
        return
    device = logits.device
    vocab_size = logits.shape[1]
    sub_rows = [rows[i] for i in penalised]
    output_counts = _token_counts([row.output_token_ids for row in sub_rows], vocab_size, device)
    # Only rows with a repetition penalty look at their prompt.
    prompt_lists = [row.prompt_token_ids if row.params.repetition_penalty != 1.0 else [] for row in sub_rows]
    prompt_seen = _token_counts(prompt_lists, vocab_size, device) > 0
    output_seen = output_counts > 0

    params = torch.tensor(
        [
            [row.params.repetition_penalty, row.params.frequency_penalty, row.params.presence_penalty]
            for row in sub_rows
        ],
        dtype=torch.float64,
        device=device,
    )
    # Any positive finite penalty is valid (vLLM's range); in the logits' dtype 1e300 would be inf and
    # 1e-300 zero, and 0 * inf or x / 0 a NaN row: they saturate at the dtype's extremes instead.
    limits = torch.finfo(logits.dtype)
    params[:, 0].clamp_(min=limits.tiny, max=limits.max)
    params = params.to(logits.dtype)
    repetition, frequency, presence = params[:, 0:1], params[:, 1:2], params[:, 2:3]
    index = torch.tensor(penalised, device=device)
    sub = logits[index]
    scaled = torch.where(sub > 0, sub / repetition, sub * repetition)
    sub = torch.where(prompt_seen | output_seen, scaled, sub)
    sub = sub - frequency * output_counts.to(sub.dtype) - presence * output_seen.to(sub.dtype)
    logits[index] = sub


def _token_counts(token_lists: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[len(token_lists), vocab_size] int32 occurrence counts, built with one scatter for the batch."""
    counts = torch.zeros(len(token_lists), vocab_size, dtype=torch.int32, device=device)
    flat = list(chain.from_iterable(token_lists))
    if not flat:
        return counts
    tokens = torch.tensor(flat, dtype=torch.long, device=device)
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.long, device=device)
    row_ids = torch.repeat_interleave(torch.arange(len(token_lists), device=device), lengths)
    counts.view(-1).scatter_add_(0, row_ids * vocab_size + tokens, torch.ones_like(tokens, dtype=torch.int32))
    return counts


def _sample(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Greedy rows take the argmax; the others draw from their filtered, tempered distribution."""
    sampled = argmax_rows(logits)
    random_rows = [i for i, row in enumerate(rows) if not row.params.is_greedy]
    if not random_rows:
        return sampled
    device = logits.device
    sub_rows = [rows[i] for i in random_rows]
    index = torch.tensor(random_rows, device=device)
    temperature = torch.tensor(
        [row.params.temperature for row in sub_rows], dtype=logits.dtype, device=device
    )
    sub = logits[index] / temperature.unsqueeze(1)
    sub = _apply_top_k(sub, [row.params.top_k for row in sub_rows])
    sub = _apply_top_p(sub, [row.params.top_p for row in sub_rows])
    sub = _apply_min_p(sub, [row.params.min_p for row in sub_rows])
    probs = torch.softmax(sub, dim=-1)
    noise = _exponential_noise(probs, sub_rows)
    sampled[index] = argmax_rows(probs / noise)
    return sampled


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    """Mask tokens below each row's k-th largest logit (ties with it stay). Works in place."""
    vocab_size = logits.shape[1]
    selected = [i for i, k in enumerate(top_k) if 0 < k < vocab_size]
    if not selected:
        return logits
    index = torch.tensor(selected, device=logits.device)
    ks = torch.tensor([top_k[i] for i in selected], device=logits.device)
    sub = logits[index]
    # A partial top-k is far cheaper than sorting the whole vocabulary.
    kth = sub.topk(max(top_k[i] for i in selected), dim=-1).values.gather(1, (ks - 1).unsqueeze(1))
    logits[index] = sub.masked_fill(sub < kth, float("-inf"))
    return logits


def _apply_top_p(logits: torch.Tensor, top_p: list[float]) -> torch.Tensor:
    """Keep a token iff the tokens strictly more likely than it hold less than top_p. Works in place."""
    selected = [i for i, p in enumerate(top_p) if p < 1.0]
    if not selected:
        return logits
    vocab_size = logits.shape[1]
    index = torch.tensor(selected, device=logits.device)
    ps = torch.tensor([top_p[i] for i in selected], dtype=logits.dtype, device=logits.device)
    sub = logits[index]
    probs = sub.softmax(dim=-1)
    # Real distributions put top_p of their mass in few tokens: look for the cut among the best
    # candidates first, and sort the whole vocabulary only for the rows where that falls short.
    threshold, covered = _top_p_threshold(probs, ps, min(vocab_size, _TOP_P_CANDIDATES))
    if not bool(covered.all()):
        rest = torch.nonzero(~covered).squeeze(1)
        threshold[rest] = _top_p_threshold(probs[rest], ps[rest], vocab_size)[0]
    logits[index] = sub.masked_fill(probs < threshold, float("-inf"))
    return logits


def _top_p_threshold(
    probs: torch.Tensor, top_p: torch.Tensor, num_candidates: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The probability of the least likely kept token, and whether the candidates reached top_p."""
    values = probs.topk(num_candidates, dim=-1).values  # descending
    cumulative = values.cumsum(dim=-1)
    # The cut is the first token at which the running mass reaches top_p.
    cut = (cumulative < top_p.unsqueeze(1)).sum(dim=-1, keepdim=True).clamp_(max=num_candidates - 1)
    return values.gather(1, cut), cumulative[:, -1] >= top_p


def _apply_min_p(logits: torch.Tensor, min_p: list[float]) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the most likely token's."""
    if not any(p > 0.0 for p in min_p):
        return logits
    probs = torch.softmax(logits, dim=-1)
    threshold = torch.tensor(min_p, dtype=logits.dtype, device=logits.device).unsqueeze(1)
    threshold = threshold * probs.amax(dim=-1, keepdim=True)
    return logits.masked_fill(probs < threshold, float("-inf"))


def _exponential_noise(probs: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Exponential(1) noise: one shared draw for unseeded rows, each seeded row from its own generator,
    a row with a pre-drawn one (`SamplingRow.noise`) that one."""
    noise = torch.empty_like(probs)
    given = [j for j, row in enumerate(rows) if row.noise is not None]
    seeded = [j for j, row in enumerate(rows) if row.params.seed is not None and row.noise is None]
    if not seeded:
        if len(given) < len(rows):
            noise.exponential_()
    else:
        unseeded = [j for j, row in enumerate(rows) if row.params.seed is None and row.noise is None]
        if unseeded:
            index = torch.tensor(unseeded, device=probs.device)
            noise[index] = torch.empty(len(unseeded), probs.shape[1], device=probs.device).exponential_()
        for j in seeded:
            generator = rows[j].generator
            if generator is None:
                raise ValueError(
                    f"SamplingRow.generator must be set for a seeded request (seed={rows[j].params.seed}); "
                    "create it once per sequence with create_generator()."
                )
            noise[j].exponential_(generator=generator)
    for j in given:
        drawn = rows[j].noise
        assert drawn is not None
        if drawn.shape != noise[j].shape:
            raise ValueError(
                f"a pre-drawn noise row has shape {tuple(drawn.shape)}, the logits rows {probs.shape[1]}"
            )
        noise[j] = drawn
    # exponential_ may return exactly 0; a zero divisor would turn a masked 0-probability token into NaN.
    return noise.clamp_min_(torch.finfo(noise.dtype).tiny)
