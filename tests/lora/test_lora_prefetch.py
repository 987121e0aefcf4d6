"""Prefetch through a real engine: an evicted adapter that a waiting request needs is read back beside
the running step, before its turn; a prefetch that fails fails nobody (the step's own load reports
the error to that adapter's requests only)."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from loraserve.demo.random_model import save_peft_adapter
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.llm_engine import LLMEngine
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams

PARAMS = SamplingParams(max_tokens=3, ignore_eos=True, temperature=0.0)
PROMPT = [5, 6, 7, 8, 9]


@pytest.fixture(scope="module")
def setup(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Path]:
    path = tiny_model("llama")
    root = tmp_path_factory.mktemp("prefetch-adapters")
    base = hf_model(path)
    for i in range(3):
        save_peft_adapter(base, str(root / f"p{i}"), seed=70 + i, base_name=path, r=8, lora_alpha=16,
                          target_modules=["q_proj", "v_proj"])  # fmt: skip
    return path, root


def _engine(model: str) -> LLMEngine:
    # One slot: the three adapters' requests run one adapter at a time; two in host memory.
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            dtype="float32",
            enable_lora=True,
            max_loras=1,
            max_cpu_loras=2,
            max_lora_rank=8,
            kv_cache_memory_bytes=32 << 20,
        )  # fmt: skip
    )


def _queue_three(engine: LLMEngine, root: Path, tmp: Path) -> list[LoRARequest]:
    """Requests on p0, p1, p2 (copied under `tmp`), queued in that order: p2's arrival evicts p1 (the
    queue needs both; p1 is needed last), so p1's request waits with its adapter out of host memory."""
    adapters = []
    for i in range(3):
        shutil.copytree(root / f"p{i}", tmp / f"p{i}")
        adapters.append(LoRARequest(f"p{i}", i + 1, str(tmp / f"p{i}")))
    for i, adapter in enumerate(adapters):
        engine.add_request(f"r{i}", PROMPT, PARAMS, adapter)
    assert engine.lora is not None
    assert engine.lora.resident_adapters()["host"] == ["p0", "p2"]
    return adapters


def _host(engine: LLMEngine) -> list[str]:
    assert engine.lora is not None
    return engine.lora.resident_adapters()["host"]


def _waiting(engine: LLMEngine) -> set[str]:
    return {seq.request.request_id for seq in engine.scheduler.waiting}


def _run(engine: LLMEngine, before_each_step: Any = None) -> dict[str, Any]:
    """Step to the end, letting the prefetch thread finish between steps; finished outputs by id."""
    assert engine.lora is not None
    finished = {}
    while engine.has_unfinished_requests():
        if before_each_step is not None:
            before_each_step()
        for output in engine.step():
            if output.finished:
                finished[output.request_id] = output
        assert engine.lora.wait_prefetch_idle(timeout=60)
    return finished


def test_a_waiting_requests_adapter_is_back_before_its_turn(setup: tuple[str, Path], tmp_path: Path) -> None:
    model, root = setup
    engine = _engine(model)
    _queue_three(engine, root, tmp_path)
    assert engine.lora is not None
    loads_before = engine.lora.stats()["lora_num_loads"]
    engine.step()  # p0 runs; the prefetch thread reads p1 back meanwhile
    assert engine.lora.wait_prefetch_idle(timeout=60)
    # Back before its turn; p0 (running) stayed, p2 (needed after p1) made room.
    assert "r1" in _waiting(engine) and _host(engine) == ["p0", "p1"]
    stats = engine.lora.stats()
    assert stats["lora_num_prefetches"] == 1 and stats["lora_num_loads"] == loads_before + 1
    loads_at_turn: list[int] = []

    def note_loads() -> None:
        if "r1" in _waiting(engine):
            loads_at_turn.append(int(engine.lora.stats()["lora_num_loads"]))  # type: ignore[union-attr]

    finished = _run(engine, note_loads)
    assert sorted(finished) == ["r0", "r1", "r2"] and all(o.error is None for o in finished.values())
    stats = engine.lora.stats()
    # p2 went for p1 and came back the same way (while p1 ran): no step waited on a read.
    assert stats["lora_num_prefetches"] == 2 and stats["lora_num_prefetch_failures"] == 0
    assert stats["lora_num_loads"] == loads_before + 2 and loads_at_turn[-1] == loads_before + 1


def test_without_prefetch_the_step_reads_the_adapter_itself(
    setup: tuple[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORASERVE_LORA_PREFETCH", "0")
    model, root = setup
    engine = _engine(model)
    _queue_three(engine, root, tmp_path)
    engine.step()
    assert "r1" in _waiting(engine) and "p1" not in _host(engine)  # nobody read it back
    finished = _run(engine)
    assert all(o.error is None for o in finished.values()) and len(finished) == 3
    assert engine.lora is not None and "lora_num_prefetches" not in engine.lora.stats()


def test_a_failed_prefetch_fails_only_that_adapters_requests(setup: tuple[str, Path], tmp_path: Path) -> None:
    model, root = setup
    engine = _engine(model)
    adapters = _queue_three(engine, root, tmp_path)
    shutil.rmtree(adapters[1].lora_path)  # p1 is out of host memory: its read back cannot work
    engine.step()
    assert engine.lora is not None and engine.lora.wait_prefetch_idle(timeout=60)
    stats = engine.lora.stats()
    assert stats["lora_num_prefetch_failures"] == 1 and stats["lora_num_prefetches"] == 0
    engine.add_request("r3", PROMPT, PARAMS, adapters[0])  # the engine takes new requests meanwhile
    finished = _run(engine)
    assert sorted(finished) == ["r0", "r1", "r2", "r3"]
    assert finished["r1"].error == (
        "LoRA adapter 'p1' is registered but its files are gone from disk; unload it, or put its files back."
    )
    assert all(
        finished[r].error is None and len(finished[r].outputs[0].token_ids) == 3 for r in ("r0", "r2", "r3")
    )
