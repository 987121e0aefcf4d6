"""Sampler: greedy, penalties, filters, seeded reproducibility, min_tokens and logprobs against naive oracles."""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
import torch

from loraserve.engine.sampler import (
    Sampler,
    SamplingRow,
    _apply_top_k,
    _apply_top_p,
    apply_penalties,
    compute_prompt_logprobs,
    create_generator,
)
from loraserve.sampling_params import SamplingParams

VOCAB = 64


def make_row(
    params: SamplingParams,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    eos: int | None = None,
) -> SamplingRow:
    generator = create_generator(params.seed, "cpu") if params.seed is not None else None
    return SamplingRow(params, prompt or [], output or [], generator, eos)


def random_tokens(rng: random.Random, max_len: int) -> list[int]:
    return [rng.randrange(VOCAB) for _ in range(rng.randrange(max_len + 1))]


def naive_penalties(logits: list[float], row: SamplingRow) -> list[float]:
    """Per-token reference of vLLM's penalties."""
    params = row.params
    seen = set(row.prompt_token_ids) | set(row.output_token_ids)
    result = []
    for token, value in enumerate(logits):
        if token in seen:
            rp = params.repetition_penalty
            value = value / rp if value > 0 else value * rp
        count = row.output_token_ids.count(token)
        value -= params.frequency_penalty * count
        value -= params.presence_penalty * (1 if count else 0)
        result.append(value)
    return result


def test_greedy_is_argmax_and_caller_logits_untouched() -> None:
    torch.manual_seed(0)
    logits = torch.randn(16, VOCAB) * 3
    before = logits.clone()
    rows = [make_row(SamplingParams(temperature=0.0, seed=i if i % 2 else None)) for i in range(16)]
    out = Sampler()(logits, rows)
    assert out.token_ids == logits.argmax(dim=-1).tolist()
    assert torch.equal(logits, before)
    assert out.top_logprobs == [None] * 16


@pytest.mark.parametrize(
    "kwargs",
    [
        {"repetition_penalty": 1.7},
        {"repetition_penalty": 0.6},
        {"frequency_penalty": 0.9},
        {"frequency_penalty": -1.2},
        {"presence_penalty": 1.5},
        {"presence_penalty": -0.7},
        {"repetition_penalty": 1.3, "frequency_penalty": 0.4, "presence_penalty": -0.3},
    ],
)
def test_penalties_match_naive_reference(kwargs: dict[str, Any]) -> None:
    rng = random.Random(1)
    torch.manual_seed(1)
    rows = []
    for i in range(12):
        # Mix penalised rows with unpenalised ones (which must stay untouched) and empty histories.
        params = SamplingParams(temperature=0.0, **kwargs) if i % 3 else SamplingParams(temperature=0.0)
        rows.append(make_row(params, random_tokens(rng, 20), random_tokens(rng, 30)))
    logits = torch.randn(len(rows), VOCAB) * 4
    penalised = logits.clone()
    apply_penalties(penalised, rows)
    expected = torch.tensor([naive_penalties(logits[i].tolist(), row) for i, row in enumerate(rows)])
    torch.testing.assert_close(penalised, expected, rtol=1e-6, atol=1e-5)
    # Greedy sampling picks the argmax of the penalised logits.
    assert Sampler()(logits, rows).token_ids == expected.argmax(dim=-1).tolist()


def _allowed_top_k(row: torch.Tensor, k: int) -> set[int]:
    kth = sorted(row.tolist(), reverse=True)[k - 1]
    return {t for t, v in enumerate(row.tolist()) if v >= kth}


def _top_p_sets(probs: list[float], top_p: float, margin: float = 1e-4) -> tuple[set[int], set[int]]:
    """(surely kept, surely dropped): a token is kept iff the mass strictly above it is below top_p."""
    kept, dropped = set(), set()
    for token, p in enumerate(probs):
        above = math.fsum(q for q in probs if q > p)
        if above < top_p - margin:
            kept.add(token)
        elif above > top_p + margin:
            dropped.add(token)
    return kept, dropped


def test_top_k_top_p_min_p_never_pick_filtered_tokens() -> None:
    torch.manual_seed(2)
    num_rows = 24
    logits = torch.randn(num_rows, VOCAB) * 2
    rows, allowed = [], []
    for i in range(num_rows):
        temperature = [0.5, 1.0, 1.7][i % 3]
        kind = i % 4
        row_logits = logits[i] / temperature
        if kind == 0:
            k = 1 + i % 7
            params = SamplingParams(temperature=temperature, top_k=k)
            allowed.append(_allowed_top_k(logits[i], k))
        elif kind == 1:
            top_p = [0.3, 0.6, 0.9][i % 3]
            params = SamplingParams(temperature=temperature, top_p=top_p)
            kept, dropped = _top_p_sets(torch.softmax(row_logits.double(), -1).tolist(), top_p)
            allowed.append(set(range(VOCAB)) - dropped)
            assert kept
        elif kind == 2:
            min_p = [0.05, 0.2, 0.5][i % 3]
            params = SamplingParams(temperature=temperature, min_p=min_p)
            probs = torch.softmax(row_logits.double(), -1)
            allowed.append(set(torch.nonzero(probs >= min_p * probs.max() * (1 - 1e-5)).flatten().tolist()))
        else:
            params = SamplingParams(temperature=temperature, top_k=5, top_p=0.8, seed=i)
            allowed.append(_allowed_top_k(logits[i], 5))
        rows.append(make_row(params))
    sampler = Sampler()
    seen: list[set[int]] = [set() for _ in range(num_rows)]
    for step in range(200):
        torch.manual_seed(1000 + step)
        out = sampler(logits, rows)
        for i, token in enumerate(out.token_ids):
            assert token in allowed[i], (i, rows[i].params, token)
            seen[i].add(token)
    # The filters leave real randomness: rows that allow several tokens visit several of them.
    assert sum(len(s) > 1 for s in seen) >= num_rows // 2


def test_top_p_and_top_k_masks_on_a_large_vocab() -> None:
    # Vocabularies above the top-p candidate count take the partial path for peaked rows and the
    # full-sort fallback for flat ones; both must keep exactly the reference set.
    torch.manual_seed(8)
    vocab_size = 1000
    scales = [0.3, 1.0, 4.0, 8.0, 0.3, 8.0]
    logits = torch.randn(len(scales), vocab_size) * torch.tensor(scales).unsqueeze(1)
    top_p = [0.5, 0.9, 0.95, 0.7, 1.0, 0.99]
    masked = _apply_top_p(logits.clone(), top_p)
    for i, p in enumerate(top_p):
        kept = set(torch.nonzero(masked[i] > float("-inf")).flatten().tolist())
        surely_kept, surely_dropped = _top_p_sets(torch.softmax(logits[i].double(), -1).tolist(), p)
        assert surely_kept <= kept and not kept & surely_dropped, i
    top_k = [1, 7, 300, -1, 0, 999]
    masked = _apply_top_k(logits.clone(), top_k)
    for i, k in enumerate(top_k):
        kept = set(torch.nonzero(masked[i] > float("-inf")).flatten().tolist())
        assert kept == (_allowed_top_k(logits[i], k) if k > 0 else set(range(vocab_size))), i


def test_sampling_follows_the_distribution() -> None:
    torch.manual_seed(3)
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.06, 0.04])
    num_rows = 20000
    logits = probs.log().repeat(num_rows, 1)
    rows = [make_row(SamplingParams(temperature=1.0)) for _ in range(num_rows)]
    counts = torch.bincount(torch.tensor(Sampler()(logits, rows).token_ids), minlength=len(probs))
    freqs = counts.double() / num_rows
    # 5 standard deviations of a binomial frequency: a wrong sampler fails, a right one essentially never.
    tolerance = 5 * torch.sqrt(probs.double() * (1 - probs.double()) / num_rows)
    assert torch.all((freqs - probs.double()).abs() < tolerance), (freqs, probs)


def test_temperature_sharpens_and_flattens() -> None:
    torch.manual_seed(4)
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]]).repeat(4000, 1)
    sampler = Sampler()
    cold = sampler(logits, [make_row(SamplingParams(temperature=0.2)) for _ in range(4000)])
    hot = sampler(logits, [make_row(SamplingParams(temperature=5.0)) for _ in range(4000)])
    assert cold.token_ids.count(0) > 3800
    assert 1200 < hot.token_ids.count(0) < 1700  # softmax([0.4, .2, 0, -.2]) ~ 0.32 of 4000


def _seeded_run(seed: int, steps: int, companions: int, logits_seq: list[torch.Tensor]) -> list[int]:
    """Sample `steps` tokens for one seeded row placed among `companions` other rows."""
    target = make_row(SamplingParams(temperature=0.9, top_p=0.95, seed=seed))
    others = [
        make_row(SamplingParams(temperature=1.0, seed=100 + j if j % 2 else None)) for j in range(companions)
    ]
    position = companions // 2
    tokens = []
    sampler = Sampler()
    for step in range(steps):
        rows = others[:position] + [target] + others[position:]
        logits = torch.randn(len(rows), VOCAB)
        logits[position] = logits_seq[step]
        out = sampler(logits, rows)
        tokens.append(out.token_ids[position])
        target.output_token_ids.append(out.token_ids[position])
    return tokens


def test_seeded_row_reproducible_and_independent_of_batch() -> None:
    torch.manual_seed(5)
    logits_seq = [torch.randn(VOCAB) for _ in range(30)]
    alone = _seeded_run(42, 30, 0, logits_seq)
    assert _seeded_run(42, 30, 0, logits_seq) == alone
    torch.manual_seed(999)  # the global RNG state must not matter either
    assert _seeded_run(42, 30, 5, logits_seq) == alone
    assert _seeded_run(42, 30, 12, logits_seq) == alone
    assert _seeded_run(43, 30, 0, logits_seq) != alone


def test_seeded_row_without_generator_is_an_error() -> None:
    row = SamplingRow(SamplingParams(seed=1), [], [], None, None)
    with pytest.raises(ValueError, match="generator"):
        Sampler()(torch.randn(1, VOCAB), [row])


def test_min_tokens_masks_eos_and_stop_tokens() -> None:
    eos, stop_id = 7, 9
    logits = torch.zeros(1, VOCAB)
    logits[0, eos], logits[0, stop_id] = 50.0, 40.0
    sampler = Sampler()

    def pick(output_len: int, **kwargs: object) -> int:
        params = SamplingParams(min_tokens=3, stop_token_ids=[stop_id], **kwargs)  # type: ignore[arg-type]
        return sampler(logits, [make_row(params, output=[1] * output_len, eos=eos)]).token_ids[0]

    for temperature in (0.0, 1.0):
        for output_len in range(3):
            assert pick(output_len, temperature=temperature) not in (eos, stop_id)
        assert pick(3, temperature=0.0) == eos
    # ignore_eos: EOS cannot end the sequence, so (as in vLLM) it is not masked; stop ids still are.
    assert pick(0, temperature=0.0, ignore_eos=True) == eos
    assert pick(5, temperature=0.0, ignore_eos=True) == eos


def _naive_rank(row: list[float], value: float) -> int:
    return 1 + sum(v > value for v in row)


def test_logprobs_are_raw_with_ranks_and_top_k() -> None:
    torch.manual_seed(6)
    rng = random.Random(6)
    logits = torch.randn(10, VOCAB) * 3
    logits[3, 10] = logits[3, 11] = logits[3].max() + 1.0  # a tie for first place
    rows = []
    for i in range(10):
        params = SamplingParams(
            temperature=[0.0, 0.7, 1.3][i % 3],
            repetition_penalty=1.5,
            frequency_penalty=0.5,
            logprobs=None if i in (4, 9) else i % 6,  # a middle row too: rows map by index
        )
        rows.append(make_row(params, random_tokens(rng, 10), random_tokens(rng, 10)))
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits.double(), dim=-1)
    for i, row in enumerate(rows):
        token = out.token_ids[i]
        entry = out.top_logprobs[i]
        if row.params.logprobs is None:
            assert entry is None and out.logprobs[i] is None  # not asked for, not computed
            continue
        assert out.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-5)
        assert entry is not None
        assert next(iter(entry)) == token  # the sampled token comes first
        expected_ids = {token} | set(torch.topk(logits[i], row.params.logprobs).indices.tolist())
        assert set(entry) == expected_ids
        values = raw[i].tolist()
        for token_id, logprob in entry.items():
            assert logprob.logprob == pytest.approx(values[token_id], abs=1e-5)
            assert logprob.rank == _naive_rank(logits[i].tolist(), logits[i, token_id].item())
    tied = out.top_logprobs[3]
    assert tied is not None and [tied[t].rank for t in (10, 11)] == [1, 1]


def test_compute_prompt_logprobs() -> None:
    torch.manual_seed(7)
    logits = torch.randn(9, VOCAB) * 2
    targets = [random.Random(i).randrange(VOCAB) for i in range(9)]
    raw = torch.log_softmax(logits.double(), dim=-1)
    for num_logprobs in (0, 1, 5):
        result = compute_prompt_logprobs(logits, targets, num_logprobs)
        assert len(result) == 9
        for i, entry in enumerate(result):
            expected = {targets[i]} | set(torch.topk(logits[i], num_logprobs).indices.tolist())
            assert set(entry) == expected
            for token_id, logprob in entry.items():
                assert logprob.logprob == pytest.approx(raw[i, token_id].item(), abs=1e-5)
                assert logprob.rank == _naive_rank(logits[i].tolist(), logits[i, token_id].item())


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="num_rows=2"):
        Sampler()(torch.randn(3, VOCAB), [make_row(SamplingParams())] * 2)
    with pytest.raises(ValueError, match="target_ids"):
        compute_prompt_logprobs(torch.randn(3, VOCAB), [1, 2], 1)


def test_ranks_of_every_token_cost_memory_linear_in_k() -> None:
    """Ranks of the top k with k = the vocabulary (vLLM's `-1`), ties included, for many positions:
    the pairwise comparison this replaced needed rows x k x k booleans (here 64 x 8192^2: 4 GiB)."""
    from loraserve.engine.sampler import compute_prompt_logprobs

    vocab = 8192
    logits = torch.randn(64, vocab)
    logits[:, 100:110] = 5.0  # a tie at the top of every row
    entries = compute_prompt_logprobs(logits, list(range(64)), vocab)
    for i in (0, 31, 63):
        row = entries[i]
        assert len(row) == vocab
        assert [row[t].rank for t in range(100, 110)] == [1] * 10
        ranked = sorted(row.items(), key=lambda kv: -kv[1].logprob)
        assert (
            ranked[10][1].rank == 11
            and ranked[-1][1].rank
            == vocab - sum(1 for lp in row.values() if lp.logprob == ranked[-1][1].logprob) + 1
        )
