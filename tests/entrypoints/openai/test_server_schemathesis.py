"""Property-based fuzzing of the whole HTTP API (from /openapi.json) against the real engine: whatever a
client sends, the answer is never a 5xx and the engine stays healthy.

The schemathesis CLI drives a live server (its pytest plugin tracks pytest internals too closely to be
a stable dependency)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from support.harness import RunningServer

from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.entrypoints.openai.server.api_server import ServerOptions


def _schemathesis() -> str:
    found = shutil.which("schemathesis") or str(Path(sys.executable).with_name("schemathesis"))
    if not Path(found).exists():
        pytest.fail("the schemathesis CLI is missing: install the test extra (pip install -e '.[test]')")
    return found


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


def test_no_server_errors(running: RunningServer, tmp_path: Path) -> None:
    # Every operation runs every phase; the coverage phase (schema boundaries and wrong types, about
    # 1,700 cases, not bounded by --max-examples) costs most, so the random fuzzing phase keeps 6 cases
    # per operation, from a fixed seed so a failure reproduces.
    command = [
        _schemathesis(), "run", running.url + "/openapi.json", "--checks", "not_a_server_error",
        "--max-examples", "6", "--seed", "20261129", "--workers", "1",
    ]
    # Run from a temporary folder: schemathesis keeps a cache (.schemathesis/) in its working directory.
    result = subprocess.run(command, capture_output=True, text=True, timeout=900, check=False, cwd=tmp_path)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert "passed" in result.stdout
    assert running.engine.is_healthy()
