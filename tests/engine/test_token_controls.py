"""The sampler's token controls (logit_bias, allowed_token_ids, bad words) against a per-row torch oracle.

The oracle applies vLLM's order to one row at a time: allowed tokens, bad words (the last token of a
sequence whose other tokens end the output), logit_bias, then min_tokens and the penalties; greedy
rows take its argmax, seeded rows the exponential race on its tempered softmax with their own
generator, so every sampled token is checked exactly.
"""

from __future__ import annotations

import random

import pytest
import torch

from loraserve.engine.sampler import Sampler, SamplingRow, create_generator
from loraserve.sampling_params import SamplingParams

VOCAB = 48
EOS = 3


def reference_logits(logits: torch.Tensor, params: SamplingParams, output: list[int]) -> torch.Tensor:
    row = logits.float().clone()
    if params.allowed_token_ids is not None:
        disallowed = torch.ones(VOCAB, dtype=torch.bool)
        disallowed[params.allowed_token_ids] = False
        row[disallowed] = float("-inf")
    for sequence in params.bad_words_token_ids or []:
        prefix = sequence[:-1]
        if len(prefix) <= len(output) and output[len(output) - len(prefix) :] == prefix:
            row[sequence[-1]] = float("-inf")
    for token_id, bias in (params.logit_bias or {}).items():
        row[token_id] += bias
    if len(output) < params.min_tokens:
        row[EOS] = float("-inf")
    if params.repetition_penalty != 1.0:
        for token_id in set(output):
            value = row[token_id]
            row[token_id] = (
                value / params.repetition_penalty if value > 0 else value * params.repetition_penalty
            )
    return row


def reference_token(logits: torch.Tensor, params: SamplingParams, output: list[int]) -> int:
    row = reference_logits(logits, params, output)
    if params.is_greedy:
        return int(row.argmax())
    assert params.seed is not None and params.top_k == -1 and params.top_p == 1.0
    probs = torch.softmax(row / params.temperature, dim=-1)
    noise = torch.empty(VOCAB).exponential_(generator=create_generator(params.seed, "cpu"))
    return int((probs / noise.clamp_min(torch.finfo(noise.dtype).tiny)).argmax())


def row_of(params: SamplingParams, output: list[int]) -> SamplingRow:
    generator = create_generator(params.seed, "cpu") if params.seed is not None else None
    return SamplingRow(params, [], output, generator, EOS)


def random_controls(rng: random.Random, output: list[int], logits: torch.Tensor) -> dict:
    """Some of the three controls; a bad word's prefix is often the output's own end and its last token
    often the row's best one, so that it applies and changes the pick."""
    kwargs: dict = {}
    if rng.random() < 0.5:
        kwargs["logit_bias"] = {
            rng.randrange(VOCAB): rng.uniform(-100, 100) for _ in range(rng.randrange(1, 6))
        }
    if rng.random() < 0.4:
        kwargs["allowed_token_ids"] = rng.sample(range(VOCAB), rng.randrange(1, 8))
    if rng.random() < 0.5:
        sequences = []
        for _ in range(rng.randrange(1, 4)):
            length = rng.randrange(0, 3)
            prefix = (
                output[len(output) - length :]
                if length and rng.random() < 0.7
                else [rng.randrange(VOCAB) for _ in range(length)]
            )
            last = int(logits.argmax()) if rng.random() < 0.6 else rng.randrange(VOCAB)
            sequences.append([*prefix, last])
        kwargs["bad_words_token_ids"] = sequences
    return kwargs


@pytest.mark.parametrize("sampled_share", [0.0, 0.5])  # 0: the greedy path, edited rows alone in float32
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("seed", range(4))
def test_mixed_batch_matches_the_oracle_row_by_row(
    dtype: torch.dtype, seed: int, sampled_share: float
) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    logits = (torch.randn(24, VOCAB) * 4).to(dtype)
    before = logits.clone()
    params_list, outputs = [], []
    for i in range(24):
        output = [rng.randrange(VOCAB) for _ in range(rng.randrange(0, 6))]
        kwargs = random_controls(rng, output, logits[i]) if i % 4 else {}  # every fourth row has none
        if rng.random() < 0.3:
            kwargs.update(repetition_penalty=1.7)
        if rng.random() < 0.3:
            kwargs.update(min_tokens=4)
        sampled = rng.random() < sampled_share
        params_list.append(
            SamplingParams(temperature=0.8 if sampled else 0.0, seed=100 + i, max_tokens=16, **kwargs)
        )
        outputs.append(output)
    out = Sampler()(logits, [row_of(p, o) for p, o in zip(params_list, outputs, strict=True)])
    for i, (params, output) in enumerate(zip(params_list, outputs, strict=True)):
        assert out.token_ids[i] == reference_token(logits[i], params, output), (i, params)
    assert torch.equal(logits, before)  # the caller's tensor is never edited


def test_a_bad_word_bans_its_last_token_only_after_its_prefix() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, 30], logits[0, 31] = 5.0, 4.0  # 30 is the greedy pick unless banned

    def pick(sequences: list[list[int]], output: list[int]) -> int:
        params = SamplingParams(temperature=0.0, bad_words_token_ids=sequences)
        return Sampler()(logits, [row_of(params, output)]).token_ids[0]

    assert pick([[30]], []) == 31  # a one-token word: always banned
    assert pick([[5, 6, 30]], [1, 5, 6]) == 31
    assert pick([[6, 30]], [1, 5, 6]) == 31
    assert pick([[4, 6, 30]], [1, 5, 6]) == 30  # the prefix differs
    assert pick([[5, 6, 30]], [5, 6, 1]) == 30  # the prefix is not at the end
    assert pick([[9, 5, 6, 30]], [5, 6]) == 30  # longer than the output allows
    assert pick([[5, 6, 30], [5, 6, 31]], [5, 6]) not in (30, 31)


def test_every_row_restricted_and_a_huge_bias() -> None:
    torch.manual_seed(1)
    logits = torch.randn(6, VOCAB) * 3
    allowed = [[5, 9], [1], [40, 41, 42], [7, 8], [0, 47], [20]]
    rows = [row_of(SamplingParams(temperature=1.0, allowed_token_ids=a), []) for a in allowed]
    for _ in range(30):  # unseeded draws: every one among the allowed tokens
        out = Sampler()(logits, rows)
        assert all(t in a for t, a in zip(out.token_ids, allowed, strict=True))
    greedy = int(logits[0].argmax())
    pushed = (greedy + 1) % VOCAB
    row = row_of(SamplingParams(temperature=0.0, logit_bias={greedy: -100.0, pushed: 100.0}), [])
    assert Sampler()(logits[:1], [row]).token_ids == [pushed]


def test_bias_comes_before_the_repetition_penalty() -> None:
    # Token 1 was generated (logit 2.0, bias +1), token 2 not (logit 2.2). vLLM's order gives
    # (2 + 1) / 1.5 = 2.0 < 2.2; the other order would give 2 / 1.5 + 1 = 2.33.
    logits = torch.full((1, VOCAB), -5.0)
    logits[0, 1], logits[0, 2] = 2.0, 2.2
    params = SamplingParams(temperature=0.0, repetition_penalty=1.5, logit_bias={1: 1.0})
    assert Sampler()(logits, [row_of(params, [1])]).token_ids == [2]


def test_allowed_tokens_and_min_tokens_combine() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS], logits[0, 10] = 9.0, 1.0
    params = SamplingParams(temperature=0.0, allowed_token_ids=[EOS, 10], min_tokens=2)
    assert Sampler()(logits, [row_of(params, [4])]).token_ids == [10]  # EOS masked before min_tokens
    assert Sampler()(logits, [row_of(params, [4, 4])]).token_ids == [EOS]


def test_logprobs_are_the_raw_ones_as_vllm_reports_them() -> None:
    torch.manual_seed(3)
    logits = torch.randn(3, VOCAB) * 2
    target = int(logits[0].argmin())
    rows = [
        row_of(SamplingParams(temperature=0.0, logprobs=2, logit_bias={target: 100.0}), []),
        row_of(SamplingParams(temperature=0.0, logprobs=1, allowed_token_ids=[target]), []),
        row_of(
            SamplingParams(temperature=0.0, logprobs=0, bad_words_token_ids=[[int(logits[2].argmax())]]), []
        ),
    ]
    out = Sampler()(logits, rows)
    raw = torch.log_softmax(logits.double(), dim=-1)
    assert out.token_ids[:2] == [target, target]
    assert out.token_ids[2] == int(logits[2].topk(2).indices[1])
    for i, token in enumerate(out.token_ids):
        assert out.logprobs[i] == pytest.approx(raw[i, token].item(), abs=1e-5)
        entry = out.top_logprobs[i]
        assert entry is not None
        top = raw[i].topk(2).indices.tolist()[: rows[i].params.logprobs]
        assert set(entry) == {token, *top}  # the top tokens of the unbiased distribution
        assert entry[token].rank == 1 + int((raw[i] > raw[i, token]).sum())
