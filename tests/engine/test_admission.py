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


def _engine(tiny_model: Any, **limits: Any) -> LLMEngine:
    """The whole queue open to one request (share 1) unless a test sets a share."""
    limits.setdefault("max_queued_share", 1.0)
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


def test_one_request_may_hold_only_its_share_of_the_queue(tiny_model: Any) -> None:
    """--max-queued-share: a request larger than its share is refused outright (400), naming the flag;
    one at its share fits, and so do others beside it."""
    engine = _engine(tiny_model, max_num_queued_reqs=8, max_num_queued_tokens=64, max_queued_share=0.5)
    with pytest.raises(
        RequestTooLargeError, match=r"5 sequences.*\(4: --max-queued-share 0.5 of --max-num-queued-reqs 8\)"
    ):
        engine.add_request("a", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, n=5))
    with pytest.raises(RequestTooLargeError, match=r"36 prompt tokens.*\(32: --max-queued-share 0.5"):
        engine.add_request("b", {"prompt_token_ids": PROMPT * 3}, SamplingParams(max_tokens=2, n=3))
    assert not engine.requests
    engine.add_request("c", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, n=4))  # its share
    engine.add_request("d", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2, n=4))  # the rest
    with pytest.raises(EngineOverloadedError):
        engine.add_request("e", {"prompt_token_ids": PROMPT}, SamplingParams(max_tokens=2))
    _run_to_completion(engine)


def test_async_engine_admits_through_the_fair_gate(tiny_model: Any) -> None:
    """AsyncLLMEngine.admit: per-key shares over the engine's limits; released holds make room."""
    import asyncio

    from loraserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=tiny_model("llama"), dtype="float32", max_num_queued_reqs=8, queue_wait_timeout_s=0)
    )

    async def main() -> None:
        hold = await engine.admit(4, 16, "key-0")
        with pytest.raises(EngineOverloadedError, match="one key's share"):
            await engine.admit(1, 4, "key-0")
        other = await engine.admit(4, 16, "key-1")
        hold.release()
        await engine.admit(4, 16, "key-0")
        other.release()
        with pytest.raises(RequestTooLargeError, match="--max-queued-share"):
            await engine.admit(5, 20, "key-2")

    asyncio.run(main())
