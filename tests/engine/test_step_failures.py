"""A failed step on the real engine (tiny Llama): only its requests fail, the engine goes on.

Faults are injected into the model's forward pass for the batch that contains a marked token, so
which step fails is decided by the test, not by timing.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.llm_engine import LLMEngine
from loraserve.engine.step_failures import MAX_CONSECUTIVE_STEP_FAILURES, StepFailureLimitError
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams

MARK = 77  # a token id only the victim's prompt contains
PROMPT = [5, 9, 12, 40, 41, 42, 43, 44, 45, 46]
VICTIM = [*PROMPT[:-1], MARK]
GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


def inject(engine: LLMEngine, fails: Callable[[torch.Tensor], bool]) -> list[int]:
    """Make the model's forward raise when `fails(input_ids)`; returns the list of raised ids' lengths."""
    model, forward, raised = engine.model, engine.model.forward, []

    def faulty(input_ids: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if fails(input_ids):
            raised.append(int(input_ids.numel()))
            raise RuntimeError("injected fault in the forward pass")
        return forward(input_ids, *args, **kwargs)

    model.forward = faulty
    return raised


def run(engine: LLMEngine) -> dict[str, RequestOutput]:
    """Step until nothing is left; the last output of each request."""
    last: dict[str, RequestOutput] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    return last


def all_blocks_free(engine: LLMEngine) -> bool:
    return engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.fixture
def engine(tiny_model: Any) -> LLMEngine:
    # One sequence at a time: a request added after the victim waits while the victim's step fails.
    return LLMEngine.from_engine_args(EngineArgs(model=tiny_model("llama"), dtype="float32", max_num_seqs=1))


def test_failed_step_fails_only_its_request(engine: LLMEngine) -> None:
    engine.add_request("reference", PROMPT, GREEDY)
    expected = run(engine)["reference"].outputs[0].token_ids
    raised = inject(engine, lambda ids: MARK in ids.tolist())
    engine.add_request("victim", VICTIM, GREEDY)
    engine.add_request("bystander", PROMPT, GREEDY)

    outputs = engine.step()  # the victim's prefill: the only request in this step
    assert raised and [out.request_id for out in outputs] == ["victim"]
    victim = outputs[0]
    assert victim.finished and victim.outputs[0].finish_reason == "error"
    assert victim.error is not None and "RuntimeError: injected fault in the forward pass" in victim.error
    assert list(engine.requests) == ["bystander"]  # it waited, and waits still
    assert [seq.request.request_id for seq in engine.scheduler.waiting] == ["bystander"]
    assert engine.check_consistency() is None
    assert engine.stats()["num_step_failures"] == 1

    bystander = run(engine)["bystander"]
    assert bystander.error is None and bystander.outputs[0].token_ids == expected
    assert all_blocks_free(engine) and engine.check_consistency() is None
    engine.add_request("after", PROMPT, GREEDY)
    assert run(engine)["after"].outputs[0].token_ids == expected


def test_failure_after_the_forward_pass_frees_the_batch(engine: LLMEngine) -> None:
    """A fault in sampling, after the KV cache was written, leaves no block or prefix entry behind."""
    sample = engine.runner.sampler.__call__
    armed = [True]

    def faulty(logits: torch.Tensor, rows: list[Any]) -> Any:
        if armed[0]:
            armed[0] = False
            raise ValueError("injected fault in the sampler")
        return sample(logits, rows)

    engine.runner.sampler = faulty  # type: ignore[assignment]
    engine.add_request("victim", PROMPT, GREEDY)
    assert engine.step()[0].error is not None
    assert all_blocks_free(engine) and engine.check_consistency() is None
    engine.add_request("after", PROMPT, GREEDY)
    fresh = LLMEngine.from_engine_args(EngineArgs(model=engine.model_config.model, dtype="float32"))
    fresh.add_request("reference", PROMPT, GREEDY)
    assert run(engine)["after"].outputs[0].token_ids == run(fresh)["reference"].outputs[0].token_ids


def test_consecutive_failures_stop_the_engine(engine: LLMEngine) -> None:
    inject(engine, lambda ids: True)
    for i in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
        engine.add_request(f"r{i}", PROMPT, GREEDY)
        assert engine.step()[0].error is not None
    engine.add_request("last", PROMPT, GREEDY)
    with pytest.raises(StepFailureLimitError, match="consecutive engine steps failed"):
        engine.step()


def test_a_successful_step_resets_the_count(engine: LLMEngine) -> None:
    inject(engine, lambda ids: MARK in ids.tolist())
    for round_ in range(2):
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
            engine.add_request(f"v{round_}.{i}", VICTIM, GREEDY)
            assert engine.step()[0].error is not None
        engine.add_request(f"ok{round_}", PROMPT, GREEDY)
        assert run(engine)[f"ok{round_}"].error is None
    assert engine.stats()["num_step_failures"] == 2 * (MAX_CONSECUTIVE_STEP_FAILURES - 1)


def test_inconsistent_state_after_a_failure_stops_the_engine(engine: LLMEngine) -> None:
    inject(engine, lambda ids: True)
    blocks = engine.block_manager
    blocks.ref_counts[blocks.num_blocks - 1] += 1  # a leaked reference (to a block the step never takes)
    engine.add_request("victim", PROMPT, GREEDY)
    with pytest.raises(StepFailureLimitError, match="inconsistent"):
        engine.step()


def test_failed_adapter_request_releases_the_adapter(
    tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The failed request no longer holds its adapter: a removal waiting on it completes."""
    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.lora.request import LoRARequest

    path = tiny_model("llama")
    adapter = str(tmp_path_factory.mktemp("step-failure-adapter") / "a")
    save_peft_adapter(hf_model(path), adapter, seed=90, base_name=path, r=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj"])
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4)
    )
    lora = LoRARequest("a", 1, adapter)
    inject(engine, lambda ids: MARK in ids.tolist())
    engine.add_request("victim", VICTIM, GREEDY, lora)
    assert engine.remove_lora(1)
    removed = engine.lora_removed(1)
    assert not removed.done()  # deferred: the victim uses the adapter
    assert engine.step()[0].error is not None
    assert removed.done() and engine.list_loras() == []
    assert engine.check_consistency() is None and all_blocks_free(engine)
    engine.add_request("after", PROMPT, GREEDY, LoRARequest("b", 2, adapter))
    assert run(engine)["after"].error is None and engine.check_consistency() is None


def test_a_failed_adapter_keeps_its_own_error_when_the_forward_pass_then_fails(
    tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """One step where an adapter fails to activate and the forward pass then raises: that adapter's
    request ends with the adapter's error (its 4xx cause), the request that ran with the step's."""
    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.errors import LoRAAdapterError
    from loraserve.lora.request import LoRARequest

    path = tiny_model("llama")
    adapter = str(tmp_path_factory.mktemp("two-failures") / "a")
    save_peft_adapter(hf_model(path), adapter, seed=91, base_name=path, r=4, lora_alpha=8,
                      target_modules=["q_proj", "v_proj"])
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=path, dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=4, max_num_seqs=2)
    )
    assert engine.lora is not None
    prepare, gone = engine.lora.prepare_step, LoRAAdapterError("LoRA adapter 'b' failed to reload (injected)")

    def adapter_two_fails(lora_ids: set[int]) -> Any:
        slots, failed = prepare(lora_ids - {2})
        return slots, {**failed, 2: gone}

    engine.lora.prepare_step = adapter_two_fails  # type: ignore[method-assign]
    raised = inject(engine, lambda ids: True)
    engine.add_request("ran", PROMPT, GREEDY, LoRARequest("a", 1, adapter))
    engine.add_request("refused", PROMPT, GREEDY, LoRARequest("b", 2, adapter))
    outputs = {out.request_id: out for out in engine.step()}
    assert raised == [len(PROMPT)]  # only the request whose adapter was activated ran
    assert outputs["refused"].error_cause is gone and outputs["refused"].outputs[0].finish_reason == "abort"
    ran = outputs["ran"]
    assert ran.error is not None and "injected fault in the forward pass" in ran.error and ran.error_cause is None
    assert engine.requests == {} and engine.check_consistency() is None and all_blocks_free(engine)
