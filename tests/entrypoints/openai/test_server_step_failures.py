"""A failed engine step seen over HTTP, on the real engine: its request gets a 500 (or an error event
and [DONE] mid-stream), /health stays 200, later requests succeed; repeated failures kill the engine
and /health says so. The forward pass raises for batches the test marks, never by timing.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from support.harness import RunningServer

from loraserve.engine.step_failures import MAX_CONSECUTIVE_STEP_FAILURES
from loraserve.entrypoints.openai.server.api_server import ServerOptions

MARK = 77  # only the victim's prompt contains this token id
PROMPT = [5, 9, 12, 40, 41, 42]
LONG_PROMPT = [5, 9, 12, 40, 41, 42, 43, 44, 45, 46, 47, 48]  # decode positions no other request reaches


@pytest.fixture
def server(tiny_model: Any) -> Iterator[RunningServer]:
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=tiny_model("llama"), dtype="float32", device="cpu", kv_cache_memory_bytes=4 << 20)
    )
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as running:
        yield running


def inject(server: RunningServer, fails: Callable[[torch.Tensor, torch.Tensor], bool]) -> None:
    """The model's forward raises for batches where `fails(input_ids, positions)`."""
    model = server.engine.engine.model
    forward = model.forward

    def faulty(input_ids: torch.Tensor, positions: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if fails(input_ids, positions):
            raise RuntimeError("injected fault at 0x7f00deadbeef")
        return forward(input_ids, positions, *args, **kwargs)

    model.forward = faulty


def complete(server: RunningServer, prompt: list[int], **extra: Any) -> Any:
    body = {"model": "base", "prompt": prompt, "max_tokens": 6, "temperature": 0, "ignore_eos": True, **extra}
    return server.http.post("/v1/completions", json=body)


def test_failed_request_gets_500_and_the_server_goes_on(server: RunningServer) -> None:
    expected = complete(server, PROMPT).json()["choices"][0]["text"]
    inject(server, lambda ids, _: MARK in ids.tolist())
    failed = complete(server, [*PROMPT, MARK])
    assert failed.status_code == 500
    error = failed.json()["error"]
    assert error["code"] == 500 and error["type"] == "InternalServerError"
    assert "engine failed while running this request" in error["message"] and "0x7f00" not in error["message"]
    assert server.http.get("/health").status_code == 200
    again = complete(server, PROMPT)
    assert again.status_code == 200 and again.json()["choices"][0]["text"] == expected
    engine = server.engine.engine
    assert server.call(lambda: engine.block_manager.num_free_blocks) == engine.block_manager.num_blocks
    metrics = server.http.get("/metrics").text
    assert "loraserve:num_step_failures_total 1.0" in metrics


def test_failure_mid_stream_is_an_error_event_then_done(server: RunningServer) -> None:
    # The third decode step of the long prompt fails: two chunks are out by then.
    fail_at = len(LONG_PROMPT) + 2
    inject(server, lambda _, positions: fail_at in positions.tolist())
    body = {"model": "base", "prompt": LONG_PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
            "stream": True}
    events = server.sse_events("/v1/completions", body)
    assert events[-1] == "[DONE]" and "error" in events[-2]
    assert events[-2]["error"]["code"] == 500 and "engine failed while running this request" in events[-2]["error"]["message"]
    assert all("choices" in event for event in events[:-2]) and len(events) > 2
    assert server.http.get("/health").status_code == 200
    assert complete(server, PROMPT).status_code == 200


def test_consecutive_failures_kill_the_engine(server: RunningServer) -> None:
    inject(server, lambda ids, _: True)
    for _ in range(MAX_CONSECUTIVE_STEP_FAILURES - 1):
        assert complete(server, PROMPT).status_code == 500
        assert server.http.get("/health").status_code == 200
    assert complete(server, PROMPT).status_code == 500
    health = server.http.get("/health")
    assert health.status_code == 500 and "consecutive" in health.json()["error"]["message"]
    assert complete(server, PROMPT).status_code == 500
