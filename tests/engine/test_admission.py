"""Admission control in the engine: a full queue turns requests away (retry later), a request larger
than the queue is refused outright, and finished work makes room again."""

from __future__ import annotations

from typing import Any

import pytest

from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.llm_engine import LLMEngine
from loraserve.entrypoints.llm import LLM
from loraserve.errors import EngineOverloadedError, RequestTooLargeError
from loraserve.sampling_params import SamplingParams

PROMPT = [5, 6, 7, 8]


def _engine(tiny_model: Any, **limits: int) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(model=tiny_model("llama"), dtype="float32", max_num_seqs=2, **limits)
    )


def _run_to_completion(engine: LLMEngine) -> None:
    while engine.has_unfinished_requests():
        engine.step()


def test_sequence_limit_counts_n_and_frees_on_finish(tiny_model: Any) -> None:
    engine = _engine(tiny_model, max_num_queued_reqs=4)
    params = SamplingParams(max_tokens=2, n=3, ignore_eos=True)
    engine.add_request("a", {"prompt_token_ids": PROMPT}, params)
    with pytest.raises(EngineOverloadedError, match="busy"):
        engine.add_request("b", {"prompt_token_ids": PROMPT}, params)  # 3 + 3 > 4
    assert "b" not in engine.requests
    engine.add_request("c", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2))  # 3 + 1 fits
    with pytest.raises(RequestTooLargeError, match="max-num-queued-reqs"):
        engine.add_request("d", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, n=5))
    _run_to_completion(engine)
    engine.add_request("b", {"prompt_token_ids": PROMPT}, params)  # room again
    _run_to_completion(engine)


def test_prefill_token_limit(tiny_model: Any) -> None:
    engine = _engine(tiny_model, max_num_queued_tokens=10)
    engine.add_request("a", {"prompt_token_ids": PROMPT * 2}, SamplingParams(max_tokens=4))  # 8 tokens
    with pytest.raises(EngineOverloadedError, match="prompt tokens"):
        engine.add_request("b", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=4))
    engine.step()  # the prompt is prefilled: its tokens leave the backlog while it decodes
    engine.add_request("b", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=4))
    with pytest.raises(RequestTooLargeError, match="max-num-queued-tokens"):
        engine.add_request("c", {"prompt_token_ids": PROMPT * 3}, SamplingParams(max_tokens=4))
    _run_to_completion(engine)


def test_offline_llm_is_not_limited(tiny_model: Any) -> None:
    """LLM.generate queues every prompt it is given: the server's limits are not the offline API's."""
    llm = LLM(tiny_model("llama"), dtype="float32", max_num_seqs=4)
    outputs = llm.generate(
        [{"prompt_token_ids": PROMPT}] * 300, SamplingParams(max_tokens=1, n=4), use_tqdm=False
    )
    assert len(outputs) == 300 and all(len(o.outputs) == 4 for o in outputs)


def test_check_admission_sees_the_queue_as_the_next_add_will(tiny_model: Any) -> None:
    engine = _engine(tiny_model, max_num_queued_reqs=4)
    engine.add_request("a", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, n=2))
    engine.check_admission(2, 8)  # 2 + 2 fits
    with pytest.raises(EngineOverloadedError):
        engine.check_admission(3, 12)
    with pytest.raises(RequestTooLargeError):
        engine.check_admission(5, 20)
    _run_to_completion(engine)
    engine.check_admission(4, 16)
