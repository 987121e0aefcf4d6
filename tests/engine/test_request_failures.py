"""A failure that belongs to one request fails that request alone (tiny Llama, the real engine): its
sampling, its beam round. The other requests of the same batch finish with the tokens they give
alone (greedy and seeded sampling), no step counts as failed, and the engine's bookkeeping is whole.
Also: beam scores saturate where a huge length_penalty made the engine step raise.
"""

from __future__ import annotations

import math
from typing import Any

import pytest

from loraserve.beam_search import BeamSearchParams, beam_score
from loraserve.engine import beam_group
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.llm_engine import LLMEngine
from loraserve.engine.sampler import Sampler
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams

POISON_SEED = 666  # the culprit's marker: its rows make the sampler raise
PROMPTS = {
    "greedy": [5, 9, 12, 40, 41],
    "seeded": [7, 8, 30, 31],
    "culprit": [11, 12, 13],
    "beam": [20, 21, 22],
}
PARAMS: dict[str, Any] = {
    "greedy": SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True),
    "seeded": SamplingParams(temperature=0.9, seed=3, max_tokens=6, ignore_eos=True, logprobs=2),
    "culprit": SamplingParams(temperature=0.7, seed=POISON_SEED, max_tokens=6, ignore_eos=True),
    "beam": BeamSearchParams(beam_width=2, max_tokens=5, length_penalty=1e308),
}


def run(engine: LLMEngine, names: list[str]) -> dict[str, RequestOutput]:
    for name in names:
        engine.add_request(name, PROMPTS[name], PARAMS[name])
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    return last


def tokens(output: RequestOutput) -> list[list[int]]:
    return [list(seq.token_ids) for seq in output.outputs]


@pytest.fixture(scope="module")
def engine(tiny_model: Any) -> LLMEngine:
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_model("llama"), dtype="float32"))


@pytest.fixture(scope="module")
def alone(engine: LLMEngine) -> dict[str, list[list[int]]]:
    return {name: tokens(run(engine, [name])[name]) for name in ("greedy", "seeded", "beam")}


def test_beam_scores_saturate() -> None:
    assert beam_score(-3.0, 5, 1e308) == 0.0 and beam_score(-3.0, 5, -1e308) == -math.inf
    assert beam_score(0.0, 5, -1e308) == 0.0 and beam_score(-3.0, 3, 1.0) == -1.0


def test_a_huge_length_penalty_is_served(alone: dict[str, list[list[int]]]) -> None:
    assert len(alone["beam"]) == 2 and all(alone["beam"])


def test_a_failed_sampling_fails_its_request_alone(
    engine: LLMEngine, alone: dict[str, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = Sampler.__call__

    def poisoned(self: Sampler, logits: Any, rows: list[Any]) -> Any:
        if any(row.params.seed == POISON_SEED for row in rows):
            raise RuntimeError("injected fault in one request's sampling")
        return real(self, logits, rows)

    monkeypatch.setattr(Sampler, "__call__", poisoned)
    before = engine.stats()
    outputs = run(engine, ["greedy", "culprit", "seeded", "beam"])
    assert (
        outputs["culprit"].finished and "injected fault in one request's sampling" in outputs["culprit"].error
    )
    for name in ("greedy", "seeded", "beam"):
        assert outputs[name].error is None and tokens(outputs[name]) == alone[name], name
    stats = engine.stats()
    assert stats["num_step_failures"] == before["num_step_failures"]
    assert stats["num_request_failures"] == before["num_request_failures"] + 1
    assert engine.check_consistency() is None and not engine.requests


def test_a_failed_beam_round_fails_its_request_alone(
    engine: LLMEngine, alone: dict[str, list[list[int]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    real = beam_group.select

    def poisoned(group: Any, live: list[Any]) -> Any:
        if live[0].num_output_tokens == 2:
            raise OverflowError("injected fault in a beam round")
        return real(group, live)

    monkeypatch.setattr("loraserve.engine.scheduler.select", poisoned)
    outputs = run(engine, ["greedy", "beam", "seeded"])
    assert "injected fault in a beam round" in outputs["beam"].error
    for name in ("greedy", "seeded"):
        assert outputs[name].error is None and tokens(outputs[name]) == alone[name], name
    assert engine.check_consistency() is None and not engine.requests
