"""Property-based fuzzing of the whole HTTP API (from /openapi.json) against the real engine: whatever a
client sends, the answer is never a 5xx and the engine stays healthy."""

from __future__ import annotations

from typing import Any

import pytest

schemathesis = pytest.importorskip("schemathesis")

from hypothesis import HealthCheck, settings  # noqa: E402
from schemathesis.checks import not_a_server_error  # noqa: E402
from test_server_harness import RunningServer  # noqa: E402

from loraserve.engine.arg_utils import EngineArgs  # noqa: E402
from loraserve.engine.async_engine import AsyncLLMEngine  # noqa: E402
from loraserve.entrypoints.openai.api_server import ServerOptions  # noqa: E402


@pytest.fixture(scope="module")
def running(tiny_model: Any):
    # max_model_len=64 bounds every generated request, whatever max_tokens the fuzzer picks.
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=tiny_model("llama"), dtype="float32", max_model_len=64, enable_lora=True,
                   max_lora_rank=8, kv_cache_memory_bytes=8 << 20)
    )
    options = ServerOptions(served_model_names=["tiny"], allow_runtime_lora_updating=True)
    with RunningServer(engine, options) as server:
        yield server


@pytest.fixture(scope="module")
def api_schema(running: RunningServer) -> Any:
    return schemathesis.openapi.from_url(running.url + "/openapi.json")


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=15, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
def test_no_server_errors(case: Any, running: RunningServer) -> None:
    case.call_and_validate(checks=[not_a_server_error])
    assert running.engine.is_healthy()
