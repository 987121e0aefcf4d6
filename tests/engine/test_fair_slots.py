"""Fair batch slots and bounded prompt-logprob steps on the real engine (tiny Llama, 8 slots): a request
of 8 sequences (n samples, beams) holds at most half the slots while another waits, so a short request
that arrives meanwhile finishes within a few steps of its own length (with `max_num_seqs_share` 1.0,
vLLM's behaviour, it waits for the whole big request); the big request's output is what it gives
alone; a long prompt asking for prompt logprobs is prefilled in bounded chunks while a short request
runs beside it. Steps are counted, not timed: nothing here depends on the machine's speed.
"""

from __future__ import annotations

from typing import Any

import pytest

from loraserve.beam_search import BeamSearchParams
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.llm_engine import LLMEngine
from loraserve.engine.logprob_budget import ENTRIES_PER_STEP
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams

SLOTS = 8
SHORT = SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True)
BIG: dict[str, Any] = {
    "n": SamplingParams(n=SLOTS, temperature=0.8, seed=11, max_tokens=24, ignore_eos=True),
    "beams": BeamSearchParams(beam_width=SLOTS, max_tokens=24, ignore_eos=True),
}


def _engine(tiny_model: Any, share: float) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=tiny_model("llama"),
            dtype="float32",
            max_num_seqs=SLOTS,
            max_num_seqs_share=share,
            max_logprobs=-1,  # vLLM's echo test: -1 asks for every token
        )
    )


def _run(
    engine: LLMEngine, late: dict[str, tuple[list[int], Any]], after_steps: int
) -> tuple[dict[str, RequestOutput], dict[str, int]]:
    """Step until idle, adding `late` requests after `after_steps` steps; (last outputs, the step each
    request finished at)."""
    last: dict[str, RequestOutput] = {}
    finished_at: dict[str, int] = {}
    step = 0
    while engine.has_unfinished_requests() or late:
        if step == after_steps:
            for name, (prompt, params) in late.items():
                engine.add_request(name, prompt, params)
            late = {}
        step += 1
        for out in engine.step():
            last[out.request_id] = out
            if out.finished:
                finished_at[out.request_id] = step
    return last, finished_at


def _ids(output: RequestOutput) -> list[list[int]]:
    return [list(seq.token_ids) for seq in output.outputs]


@pytest.fixture(scope="module")
def alone(tiny_model: Any) -> dict[str, list[list[int]]]:
    engine = _engine(tiny_model, 1.0)
    result = {}
    for name, params in BIG.items():
        engine.add_request(name, [5, 6, 7, 8], params)
        result[name] = _ids(_run(engine, {}, 0)[0][name])
    engine.add_request("short", [9, 10, 11], SHORT)
    result["short"] = _ids(_run(engine, {}, 0)[0]["short"])
    return result


@pytest.mark.parametrize("kind", ["n", "beams"])
def test_a_short_request_is_not_held_behind_a_big_one(tiny_model: Any, alone: dict, kind: str) -> None:
    engine = _engine(tiny_model, 0.5)
    engine.add_request(kind, [5, 6, 7, 8], BIG[kind])
    outputs, finished_at = _run(engine, {"short": ([9, 10, 11], SHORT)}, after_steps=4)
    # Its slot comes at once (one of the big request's sequences yields): prefill + 2 tokens.
    assert finished_at["short"] - 4 <= 3, finished_at
    assert _ids(outputs["short"]) == alone["short"]
    assert _ids(outputs[kind]) == alone[kind]  # yielding changed nothing in the big request's output
    assert engine.scheduler.num_yielded > 0
    assert engine.check_consistency() is None


def test_vllm_behaviour_with_share_one(tiny_model: Any) -> None:
    engine = _engine(tiny_model, 1.0)
    engine.add_request("n", [5, 6, 7, 8], BIG["n"])
    _, finished_at = _run(engine, {"short": ([9, 10, 11], SHORT)}, after_steps=4)
    assert finished_at["short"] > finished_at["n"]  # it waited for all 8 sequences to finish


def test_prompt_logprobs_are_computed_in_bounded_steps(tiny_model: Any) -> None:
    engine = _engine(tiny_model, 0.5)
    vocab = engine.model_config.vocab_size
    long_prompt = [(7 * i) % 400 + 5 for i in range(250)]
    params = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=vocab)  # every token: k = vocab
    engine.add_request("alone", long_prompt, params)
    reference = _run(engine, {}, 0)[0]["alone"].prompt_logprobs
    engine.add_request("long", long_prompt, params)
    outputs, finished_at = _run(engine, {"short": ([9, 10, 11], SHORT)}, after_steps=1)
    rows_per_step = ENTRIES_PER_STEP // (vocab + 1)
    assert finished_at["long"] >= 1 + (len(long_prompt) - 1) // rows_per_step  # chunked that small
    assert finished_at["short"] <= 1 + 3  # scheduled beside it at once
    got = outputs["long"].prompt_logprobs
    assert got is not None and reference is not None and len(got) == len(reference) == len(long_prompt)
    for mine, theirs in zip(got[1:], reference[1:], strict=True):
        assert mine.keys() == theirs.keys()
        token = next(iter(mine))
        assert mine[token].rank == theirs[token].rank
        assert abs(mine[token].logprob - theirs[token].logprob) < 1e-4


def test_logprobs_beyond_the_entry_bound_are_refused(tiny_model: Any) -> None:
    from loraserve.engine.request_prep import MAX_LOGPROB_ENTRIES
    from loraserve.sampling_tokens import SamplingParamsError

    engine = _engine(tiny_model, 0.5)
    vocab = engine.model_config.vocab_size
    n = MAX_LOGPROB_ENTRIES // (vocab + 1) // 200 + 1  # n x 200 positions x (vocab + 1) entries: one over
    with pytest.raises(SamplingParamsError, match="logprobs=512 over") as caught:
        engine.add_request("big", [5, 6], SamplingParams(n=n, max_tokens=200, logprobs=vocab))
    assert caught.value.parameter == "logprobs" and not engine.requests
    engine.add_request("fine", [5, 6], SamplingParams(n=n, max_tokens=200, logprobs=20))  # vLLM's default k


@pytest.mark.parametrize(("priority", "waits"), [(1, True), (0, False)])
def test_under_the_priority_policy_only_as_good_a_request_gets_a_slot(
    tiny_model: Any, priority: int, waits: bool
) -> None:
    engine = LLMEngine.from_engine_args(
        EngineArgs(
            model=tiny_model("llama"), dtype="float32", max_num_seqs=SLOTS, scheduling_policy="priority"
        )
    )
    engine.add_request("n", [5, 6, 7, 8], BIG["n"], priority=0)
    for _ in range(4):
        engine.step()
    engine.add_request("short", [9, 10, 11], SHORT, priority=priority)
    _, finished_at = _run(engine, {}, 0)
    assert (finished_at["short"] > finished_at["n"]) is waits, finished_at
