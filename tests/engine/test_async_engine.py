"""AsyncLLMEngine lifecycle on a real tiny model: failed steps, crashes, aborts, unloads, pinning, shutdown."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from loraserve.demo.random_model import save_peft_adapter
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.engine.step_failures import MAX_CONSECUTIVE_STEP_FAILURES
from loraserve.entrypoints.openai.serving.engine_client import EngineClient
from loraserve.errors import EngineDeadError, LoRAAdapterNotFoundError
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def adapters(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    path = tiny_model("llama")
    root = tmp_path_factory.mktemp("async-adapters")
    paths = []
    for i in range(3):
        paths.append(str(root / f"a{i}"))
        save_peft_adapter(hf_model(path), paths[-1], seed=70 + i, base_name=path, r=4, lora_alpha=8,
                          target_modules=["q_proj", "v_proj"])
    return paths


def _engine(path: str, **kwargs: Any) -> AsyncLLMEngine:
    return AsyncLLMEngine.from_engine_args(EngineArgs(model=path, dtype="float32", **kwargs))


async def _collect(engine: AsyncLLMEngine, request_id: str, max_tokens: int = 6,
                   lora: LoRARequest | None = None) -> Any:
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    last = None
    async for out in engine.generate("hello world", params, request_id, lora):
        last = out
    return last


def test_a_failed_step_fails_its_requests_and_the_engine_goes_on(tiny_model: Any) -> None:
    async def main() -> None:
        engine = _engine(tiny_model("llama"))
        await engine.start()
        runner, execute = engine.engine.runner, engine.engine.runner.execute
        armed = [True]

        def broken_once(*args: Any, **kwargs: Any) -> Any:
            if armed[0]:
                armed[0] = False
                raise RuntimeError("boom")
            return execute(*args, **kwargs)

        runner.execute = broken_once  # type: ignore[method-assign]
        failed = await _collect(engine, "failed")
        assert failed.finished and "RuntimeError: boom" in failed.error
        assert engine.is_healthy() and engine.stats()["num_step_failures"] == 1
        ok = await _collect(engine, "ok")
        assert ok.error is None and len(ok.outputs[0].token_ids) == 6
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_consecutive_failed_steps_kill_the_engine(tiny_model: Any) -> None:
    async def main() -> None:
        engine = _engine(tiny_model("llama"))
        await engine.start()
        runner = engine.engine.runner

        def broken(*args: Any, **kwargs: Any) -> Any:
            raise RuntimeError("boom")

        runner.execute = broken  # type: ignore[method-assign]
        for i in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):  # one request per step, one step after another
            assert "boom" in (await _collect(engine, f"r{i}")).error
            assert engine.is_healthy()
        with pytest.raises(EngineDeadError, match="consecutive"):
            await _collect(engine, "last")
        assert not engine.is_healthy()
        with pytest.raises(EngineDeadError):
            await _collect(engine, "late")
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_external_abort_ends_the_stream_and_id_is_reusable(tiny_model: Any) -> None:
    async def main() -> None:
        engine = _engine(tiny_model("llama"))
        assert isinstance(engine, EngineClient)  # what the serving layer is typed against
        await engine.start()
        params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        outputs = []
        async for out in engine.generate("abc", params, "same-id"):
            outputs.append(out)
            if len(outputs) == 2:
                await engine.abort("same-id")
        assert outputs[-1].finished and outputs[-1].outputs[0].finish_reason == "abort"
        again = await _collect(engine, "same-id")
        assert again.finished and len(again.outputs[0].token_ids) == 6
        assert not engine.engine.has_unfinished_requests()
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await _collect(engine, "after-shutdown")

    asyncio.run(asyncio.wait_for(main(), 60))


def test_unloaded_adapter_is_not_reloaded_by_a_late_request(tiny_model: Any, adapters: list[str]) -> None:
    async def main() -> None:
        engine = _engine(tiny_model("llama"), enable_lora=True, max_loras=2, max_lora_rank=4)
        await engine.start()
        lora = LoRARequest("a0", 1, adapters[0])
        assert await engine.add_lora(lora)
        first = await _collect(engine, "x", lora=lora)
        assert first.finished
        assert await engine.remove_lora(1)
        with pytest.raises(LoRAAdapterNotFoundError):
            await _collect(engine, "y", lora=lora)
        assert await engine.list_loras() == []
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_pinned_adapter_never_overfills_slots(tiny_model: Any, adapters: list[str]) -> None:
    async def main() -> None:
        engine = _engine(tiny_model("llama"), enable_lora=True, max_loras=2, max_cpu_loras=3, max_lora_rank=4)
        await engine.start()
        loras = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters)]
        for lora in loras:
            await engine.add_lora(lora)
        assert await engine.pin_lora(1)
        results = await asyncio.gather(*[_collect(engine, f"p{i}", lora=loras[1 + i % 2]) for i in range(6)])
        assert all(r.finished and len(r.outputs[0].token_ids) == 6 for r in results)
        assert engine.is_healthy()
        await engine.shutdown()

    asyncio.run(asyncio.wait_for(main(), 60))


def test_remove_waits_for_running_requests_and_fails_on_shutdown(tiny_model: Any, adapters: list[str]) -> None:
    async def removal_behind_a_running_request(engine: AsyncLLMEngine, lora: LoRARequest) -> Any:
        params = SamplingParams(temperature=0.0, max_tokens=500, ignore_eos=True)
        stream = engine.generate("hello world", params, f"long-{lora.lora_name}", lora)
        await stream.__anext__()  # the request runs
        removal = asyncio.create_task(engine.remove_lora(lora.lora_id))
        while await engine.list_loras():  # unlisted once the removal waits for the request
            await asyncio.sleep(0.01)
        assert not removal.done()
        return stream, removal

    async def main() -> None:
        engine = _engine(tiny_model("llama"), enable_lora=True, max_loras=2, max_lora_rank=4)
        await engine.start()
        lora = LoRARequest("a0", 1, adapters[0])
        _, removal = await removal_behind_a_running_request(engine, lora)
        await engine.abort(f"long-{lora.lora_name}")
        assert await removal
        with pytest.raises(LoRAAdapterNotFoundError):
            await _collect(engine, "late", lora=lora)
        # A removal still waiting when the engine shuts down fails instead of hanging.
        _, removal = await removal_behind_a_running_request(engine, LoRARequest("a1", 2, adapters[1]))
        await engine.shutdown()
        with pytest.raises(EngineDeadError):
            await removal

    asyncio.run(asyncio.wait_for(main(), 60))
