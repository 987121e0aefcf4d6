"""The engine with a quantized KV cache (`kv_cache_dtype`): close to the full-precision run, the same
alone and in a batch, with prefix-cache hits and with preemption.

"Close" is stated per format as a bound on the chosen tokens' logprobs (a float32 tiny Llama, greedy):
the tokens are the float32 run's until, at most, a step where that run's top two logprobs are within
twice the bound (a near-tie the format's error may flip); before it every logprob is within the bound.
"""

from __future__ import annotations

import math
from typing import Any

import pytest
import torch

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
