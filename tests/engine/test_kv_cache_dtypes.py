"""The engine with a quantized KV cache (`kv_cache_dtype`): close to the full-precision run, the same
alone and in a batch, with prefix-cache hits, with preemption and with speculative decoding.

"Close" is stated per format as a bound on the chosen tokens' logprobs (a float32 tiny Llama, greedy):
the tokens are the float32 run's until, at most, a step where that run's top two logprobs are within
twice the bound (a near-tie the format's error may flip); before it every logprob is within the bound.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch
from support.speculative import both_ways, repetitive
from support.speculative import run as run_checked

from loraserve import LLM, SamplingParams
from loraserve.outputs import RequestOutput

# Bounds on |logprob - the float32 cache's logprob| of a chosen token: a few times the largest seen
# on this model (bf16 4e-4, e4m3 4e-3, e5m2 9e-3, int8 1.2e-3).
LOGPROB_BOUND = {"bfloat16": 0.002, "fp8": 0.015, "fp8_e5m2": 0.03, "int8": 0.005}
PARAMS = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True, logprobs=2)


def _prompts(lengths: tuple[int, ...] = (5, 40, 23, 61), seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 512, (n,), generator=g).tolist() for n in lengths]


def _run(llm: LLM, prompts: list[list[int]], params: SamplingParams = PARAMS) -> list[RequestOutput]:
    return llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)


def _assert_close(base: list[RequestOutput], got: list[RequestOutput], bound: float) -> None:
    for b, g in zip(base, got, strict=True):
        ours, theirs = g.outputs[0], b.outputs[0]
        assert len(ours.token_ids) == len(theirs.token_ids)
        assert ours.logprobs is not None and theirs.logprobs is not None
        for i, (mine, want) in enumerate(zip(ours.token_ids, theirs.token_ids, strict=True)):
            if mine != want:
                top = sorted((lp.logprob for lp in theirs.logprobs[i].values()), reverse=True)
                assert top[0] - top[1] <= 2 * bound, f"diverged at step {i} without a near-tie"
                break
            assert math.isclose(
                ours.logprobs[i][want].logprob, theirs.logprobs[i][want].logprob, abs_tol=bound
            )


@pytest.fixture(scope="module")
def llama_path(tiny_model: Any) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def float32_run(llama_path: str) -> list[RequestOutput]:
    return _run(LLM(llama_path, dtype="float32"), _prompts())


@pytest.mark.parametrize("kv_cache_dtype", list(LOGPROB_BOUND))
def test_quantized_cache_stays_close_to_full_precision(
    llama_path: str, float32_run: list[RequestOutput], kv_cache_dtype: str
) -> None:
    llm = LLM(llama_path, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    _assert_close(float32_run, _run(llm, _prompts()), LOGPROB_BOUND[kv_cache_dtype])


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "int8"])
def test_a_mixed_batch_gives_each_request_what_it_gets_alone(llama_path: str, kv_cache_dtype: str) -> None:
    """Each sequence's blocks (and int8's block scales) are its own: a batch changes only the kernel's
    summation order."""
    llm = LLM(llama_path, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    prompts = _prompts((7, 33, 18), seed=1)
    params = [
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=12, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, repetition_penalty=1.3, logprobs=1),
    ]
    alone = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p, sp in zip(prompts, params)]
    together = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    for a, t in zip(alone, together, strict=True):
        assert t.outputs[0].token_ids == a.outputs[0].token_ids
        assert a.outputs[0].logprobs is not None and t.outputs[0].logprobs is not None
        for token, la, lt in zip(a.outputs[0].token_ids, a.outputs[0].logprobs, t.outputs[0].logprobs):
            assert math.isclose(lt[token].logprob, la[token].logprob, abs_tol=1e-4)


@pytest.mark.parametrize("kv_cache_dtype", ["fp8_e5m2", "int8"])
def test_prefix_cache_hits_reuse_quantized_blocks(llama_path: str, kv_cache_dtype: str) -> None:
    """A second prompt sharing three full blocks reads them (and their scales) from the first one's
    prefill: what it gets equals a run without the prefix cache."""
    shared = _prompts((48,), seed=2)[0]
    prompts = [shared + [5, 9, 11], shared + [7, 3]]
    params = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True, logprobs=1)
    cached = LLM(llama_path, dtype="float32", kv_cache_dtype=kv_cache_dtype)
    first = _run(cached, prompts[:1], params)
    second = _run(cached, prompts[1:], params)
    assert second[0].num_cached_tokens == 48
    fresh = LLM(llama_path, dtype="float32", kv_cache_dtype=kv_cache_dtype, enable_prefix_caching=False)
    for got, want in zip(first + second, _run(fresh, prompts[:1], params) + _run(fresh, prompts[1:], params)):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for token, lg, lw in zip(
            got.outputs[0].token_ids, got.outputs[0].logprobs or [], want.outputs[0].logprobs or []
        ):
            assert math.isclose(lg[token].logprob, lw[token].logprob, abs_tol=1e-4)


def test_preempted_sequences_recompute_into_an_int8_cache(
    llama_path: str, float32_run: list[RequestOutput]
) -> None:
    """12 blocks of 8 tokens for sequences needing 24 at the end: the scheduler preempts and recomputes
    (the recomputed blocks are quantized as one prefill, not row by row); the outputs stay as close to
    the float32 cache's as without preemption."""
    tight = LLM(
        llama_path,
        dtype="float32",
        kv_cache_dtype="int8",
        block_size=8,
        num_kv_blocks=12,
        max_model_len=96,
        enable_prefix_caching=False,
    )
    outs = _run(tight, _prompts())
    assert tight.engine.scheduler.num_preemptions > 0
    _assert_close(float32_run, outs, LOGPROB_BOUND["int8"])


NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
         "draft_policy": "always"}  # fmt: skip


@pytest.mark.parametrize("kv_cache_dtype", list(LOGPROB_BOUND))
def test_speculation_over_each_kv_format(llama_path: str, kv_cache_dtype: str) -> None:
    """Verified proposals over a quantized cache. bf16 and fp8 store each value alone, so a round's rows
    are the decode steps' bits: outputs equal those without speculation, logprobs too. An int8 block's
    scale follows every row written to it, rejected proposals' rows too, so int8 with speculation is
    not the bits of int8 without it; it stays within int8's bound of the float32 cache."""
    prompts = repetitive(6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    options: dict[str, Any] = dict(dtype="float32", max_model_len=256, kv_cache_dtype=kv_cache_dtype)
    speculating = LLM(llama_path, **options, speculative_config=NGRAM)
    got, counts = run_checked(speculating, prompts, params)
    both_ways(counts)
    if kv_cache_dtype == "int8":
        float32, _ = run_checked(LLM(llama_path, dtype="float32", max_model_len=256), prompts, params)
        _assert_close(float32, got, LOGPROB_BOUND["int8"])
        return
    expected, _ = run_checked(LLM(llama_path, **options), prompts, params)
    for g, e in zip(got, expected, strict=True):
        assert g.outputs[0].token_ids == e.outputs[0].token_ids
        assert g.outputs[0].logprobs == e.outputs[0].logprobs


def test_a_draft_model_keeps_the_targets_kv_format(llama_path: str) -> None:
    """The draft model's own cache takes --kv-cache-dtype too (as many blocks as the target's, so an
    8-bit target cache never comes with a float32 draft cache 4x its size); outputs stay the bits of
    the fp8 run without speculation. (The target drafts for itself: its greedy proposals are accepted.)"""
    prompts = repetitive(4, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=1)
    options: dict[str, Any] = dict(dtype="float32", max_model_len=256, kv_cache_dtype="fp8")
    draft = {"model": llama_path, "num_speculative_tokens": 3, "draft_policy": "always"}
    speculating = LLM(llama_path, **options, speculative_config=draft)
    runner = speculating.engine.speculator.draft.runner
    assert all(cache.dtype == torch.float8_e4m3fn for cache in runner.kv_caches)
    assert runner.kv_caches[0].k.shape[0] == speculating.engine.kv_budget.num_blocks * 16
    got, counts = run_checked(speculating, prompts, params)
    assert counts["num_accepted_tokens"] > 0
    expected, _ = run_checked(LLM(llama_path, **options), prompts, params)
    assert [g.outputs[0].token_ids for g in got] == [e.outputs[0].token_ids for e in expected]
    assert [g.outputs[0].logprobs for g in got] == [e.outputs[0].logprobs for e in expected]
