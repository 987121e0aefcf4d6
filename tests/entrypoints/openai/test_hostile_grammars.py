"""Grammar compiles under hostile input, on a live server (tiny random Llama): a runaway regex is a 400
naming its field once the compile timeout kills its worker, one API key's compiles hold at most its
share of the workers, a cached grammar and a neighbour's new one are served meanwhile with the
output they give alone, an over-budget
constraint is refused before anything compiles. (A client that leaves, and SIGTERM during an attack:
test_hostile_process.py, on a real process.)

`".*"` repeated compiles in time growing faster than the square of its length (400 characters: 2.5 s
at this 512-token vocabulary on an AVX2 EPYC); 4,000 characters would take minutes, so on any
machine it outlives the 1 s timeout many times over.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from support.harness import RunningServer, wait_for

from loraserve.entrypoints.openai.server.api_server import ServerOptions

RUNAWAY = ".*" * 2000
TIMEOUT_S = 1.0
# A neighbour's short request on the tiny model takes milliseconds; the bound leaves room for a
# loaded test machine and still catches a request queued behind a compile (seconds to minutes).
NEIGHBOUR_BOUND_S = 5.0
# The first compile also starts the fork server (imports xgrammar and torch: seconds).
REFUSAL_BOUND_S = TIMEOUT_S + 30.0
ATTACKER, NEIGHBOUR = "attacker-key", "neighbour-key"


@pytest.fixture(scope="module")
def server(tiny_model: Any):
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(
            model=tiny_model("llama"),
            dtype="float32",
            max_model_len=256,
            kv_cache_memory_bytes=16 << 20,
            structured_outputs_compile_timeout=TIMEOUT_S,
            structured_outputs_compile_workers=2,
        )
    )
    with RunningServer(
        engine, ServerOptions(served_model_names=["base"], api_keys=[ATTACKER, NEIGHBOUR])
    ) as running:
        yield running


def _post(server: RunningServer, key: str, body: dict, timeout: float = 60) -> tuple[httpx.Response, float]:
    start = time.monotonic()
    response = httpx.post(
        server.url + "/v1/completions",
        json={"model": "base", "prompt": "hello", "max_tokens": 8, "temperature": 0.0, **body},
        headers={"Authorization": f"Bearer {key}"},
        timeout=timeout,
    )
    return response, time.monotonic() - start


def _compiles(server: RunningServer) -> dict[str, int]:
    return server.call(lambda: server.engine.engine.structured.compile_stats())


def _attack(server: RunningServer, results: list[Any], body: dict) -> threading.Thread:
    thread = threading.Thread(target=lambda: results.append(_post(server, ATTACKER, body)), daemon=True)
    thread.start()
    return thread


def test_a_runaway_regex_is_a_400_while_neighbours_are_served(server: RunningServer) -> None:
    alone, _ = _post(server, NEIGHBOUR, {"response_format": {"type": "json_object"}})
    plain_alone, _ = _post(server, NEIGHBOUR, {})
    assert alone.status_code == plain_alone.status_code == 200, alone.text
    results: list[Any] = []
    attackers = [_attack(server, results, {"guided_regex": RUNAWAY + "a" * i}) for i in range(3)]
    wait_for(lambda: _compiles(server).get("grammar_compiles_running", 0) == 1, 60, "an attacker compiling")
    # The attacker's key holds one of the two workers (its share) and queues the rest; meanwhile a
    # cached grammar, a new one on the other worker, and a free-text request are all served.
    cached, cached_s = _post(server, NEIGHBOUR, {"response_format": {"type": "json_object"}})
    fresh, fresh_s = _post(server, NEIGHBOUR, {"guided_regex": "[a-c]{2,4}-[0-9]{1,3}"})
    plain, plain_s = _post(server, NEIGHBOUR, {})
    assert _compiles(server)["grammar_compiles_running"] <= 1  # never two of the attacker's at once
    for thread in attackers:
        thread.join(REFUSAL_BOUND_S * 3)
    assert [r.status_code for r in (cached, fresh, plain)] == [200, 200, 200]
    assert cached.json()["choices"][0]["text"] == alone.json()["choices"][0]["text"]
    assert plain.json()["choices"][0]["text"] == plain_alone.json()["choices"][0]["text"]
    assert max(cached_s, fresh_s, plain_s) < NEIGHBOUR_BOUND_S, (cached_s, fresh_s, plain_s)
    assert len(results) == 3
    for response, _ in results:
        error = response.json()["error"]
        assert response.status_code == 400 and error["param"] == "guided_regex", error
        assert "did not compile within 1 s" in error["message"]
    assert _compiles(server)["grammar_compile_timeouts"] >= 3


def test_a_runaway_tool_schema_is_a_400_naming_tools(server: RunningServer) -> None:
    tool = {
        "type": "function",
        "function": {
            "name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "string", "pattern": RUNAWAY}}},
        },
    }
    start = time.monotonic()
    response = httpx.post(
        server.url + "/v1/chat/completions",
        json={
            "model": "base",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [tool],
            "tool_choice": "required",
            "max_tokens": 8,
        },
        headers={"Authorization": f"Bearer {ATTACKER}"},
        timeout=60,
    )
    assert response.status_code == 400 and response.json()["error"]["param"] == "tools", response.text
    assert time.monotonic() - start < REFUSAL_BOUND_S


def test_an_over_budget_constraint_is_refused_before_compiling(server: RunningServer) -> None:
    before = _compiles(server)
    response, elapsed = _post(server, ATTACKER, {"guided_regex": "a" * 300_000})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "guided_regex", error
    assert "at most 262144 are compiled" in error["message"]
    assert _compiles(server)["grammar_compile_workers_started"] == before["grammar_compile_workers_started"]
