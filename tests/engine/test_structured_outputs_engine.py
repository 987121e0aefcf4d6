"""Structured outputs in the engine: a grammar's state survives preemption (recompute), a dead end
stops with finish_reason "stop", and unconstrained greedy requests are unchanged by sharing a batch
with constrained ones."""

from __future__ import annotations

import re
from typing import Any

import pytest

from loraserve.entrypoints.llm import LLM
from loraserve.sampling_params import SamplingParams

REGEX = r"[a-d]{3,6}-[0-9]{2,4}"


@pytest.fixture(scope="module")
def model_dir(tiny_model: Any) -> str:
    return tiny_model("llama")


def _regex_params(seed: int) -> SamplingParams:
    return SamplingParams(max_tokens=40, temperature=1.0, seed=seed, structured_outputs={"regex": REGEX})


def test_preemption_keeps_each_grammar_right(model_dir: str) -> None:
    # 12 KV blocks of 16 tokens for 8 sequences of ~50 tokens: sequences are preempted and recomputed.
    llm = LLM(
        model_dir,
        dtype="float32",
        num_kv_blocks=12,
        block_size=16,
        max_model_len=64,
        enable_prefix_caching=False,
    )
    prompts = [f"prompt number {i} says" for i in range(8)]
    outputs = llm.generate(prompts, [_regex_params(i) for i in range(8)], use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    roomy = LLM(model_dir, dtype="float32", max_model_len=64, enable_prefix_caching=False)
    alone = roomy.generate(prompts, [_regex_params(i) for i in range(8)], use_tqdm=False)
    for out, ref in zip(outputs, alone, strict=True):
        assert out.outputs[0].finish_reason == "stop"
        assert re.fullmatch(REGEX, out.outputs[0].text), out.outputs[0].text
        assert out.outputs[0].token_ids == ref.outputs[0].token_ids  # seeded: preemption changed nothing


def test_dead_end_stops_and_unconstrained_rows_are_untouched(model_dir: str) -> None:
    llm = LLM(model_dir, dtype="float32", max_model_len=96)
    free = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    alone = llm.generate(["tell me", "more text"], free, use_tqdm=False)
    # ignore_eos: once "no" is written the grammar allows only its stop token, which does not stop the
    # sequence, so the next mask finds a dead end.
    stuck = SamplingParams(
        max_tokens=24, temperature=0.0, ignore_eos=True, structured_outputs={"choice": ["no"]}
    )
    mixed = llm.generate(["tell me", "x", "more text"], [free, stuck, free], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in (mixed[0], mixed[2])] == [o.outputs[0].token_ids for o in alone]
    dead = mixed[1].outputs[0]
    assert dead.finish_reason == "stop" and dead.text == "no" and len(dead.token_ids) < 24


def test_the_async_engine_compiles_in_worker_processes(
    model_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A new schema compiles in a compile worker process before the request is queued: nothing in this
    process compiles (neither the engine thread nor another), the same schema again is a cache hit,
    and a bad schema is refused before anything is queued."""
    import asyncio

    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine
    from loraserve.structured_output import xgrammar_backend

    in_process: list[Any] = []
    monkeypatch.setattr(xgrammar_backend, "compile_key", lambda *args: in_process.append(args))
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=model_dir, dtype="float32", max_model_len=64))
    params = SamplingParams(max_tokens=20, temperature=0.0, structured_outputs={"regex": REGEX})
    bad = SamplingParams(max_tokens=4, structured_outputs={"regex": "(a"})

    async def run(request_id: str, sampling: SamplingParams) -> str:
        text = ""
        async for output in engine.generate("hello", sampling, request_id):
            text = output.outputs[0].text
        return text

    async def main() -> tuple[list[str], dict[str, Any], bool]:
        await engine.start()
        try:
            texts = [await run("r1", params), await run("r3", params)]
            with pytest.raises(ValueError, match="Failed to transform regex"):
                await run("r2", bad)
            return texts, engine.stats(), engine.engine.has_unfinished_requests()
        finally:
            await engine.shutdown()

    texts, stats, unfinished = asyncio.run(main())
    assert re.fullmatch(REGEX, texts[0]) and texts[1] == texts[0], texts
    assert in_process == [] and stats["grammar_compiles"] == 1  # r1's; r2's failed there too
    cache = engine.engine.structured.backend.cache
    assert (cache.misses, cache.hits) == (1, 1)  # r3 found r1's grammar
    assert not unfinished


def test_each_of_n_sequences_has_its_own_grammar(model_dir: str) -> None:
    llm = LLM(model_dir, dtype="float32", max_model_len=64)
    choices = ["alpha", "beta", "gamma delta"]
    params = SamplingParams(
        n=6, max_tokens=16, temperature=1.5, seed=5, structured_outputs={"choice": choices}
    )
    outputs = llm.generate(["pick one"], params, use_tqdm=False)[0].outputs
    assert len(outputs) == 6
    assert all(o.text in choices and o.finish_reason == "stop" for o in outputs), [o.text for o in outputs]
