"""Grammar compiles under hostile input, on a live server (tiny random Llama): a runaway regex is a 400
naming its field once the compile timeout kills its worker, one API key's compiles hold at most its
share of the workers, a cached grammar and a neighbour's new one are served meanwhile with the
output they give alone, a client that leaves takes its compile down with it, an over-budget
constraint is refused before anything compiles, and SIGTERM during an attack exits promptly.

`".*"` repeated compiles in time growing faster than the square of its length (400 characters: 2.5 s
at this 512-token vocabulary on an AVX2 EPYC); 4,000 characters would take minutes, so on any
machine it outlives the 1 s timeout many times over.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
import time
from typing import Any

import httpx
import pytest
from support.harness import RunningServer, wait_for
from support.serve_process import ServeProcess

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


def _metric(process: ServeProcess, name: str) -> float:
    for line in httpx.get(process.url + "/metrics", timeout=10).text.splitlines():
        if line.startswith(f"loraserve:{name} "):
            return float(line.split()[-1])
    return 0.0


def _send(process: ServeProcess, regex: str) -> socket.socket:
    """A completion request with this guided_regex, sent on a raw connection the test can drop."""
    body = json.dumps({"model": "base", "prompt": "x", "max_tokens": 4, "guided_regex": regex}).encode()
    sock = socket.create_connection(("127.0.0.1", process.port))
    head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    sock.sendall(head.encode() + body)
    return sock


def test_a_client_that_leaves_takes_its_compile_down_and_sigterm_waits_for_none(tiny_model: Any) -> None:
    """A real process whose compile timeout is far away: a client that disconnects while its runaway
    regex compiles has the compile withdrawn and its worker killed; then SIGTERM while runaway compiles
    run and wait exits 0 within --shutdown-timeout plus the drain's margin: no compile is waited for."""
    flags = [
        tiny_model("llama"),
        "--dtype",
        "float32",
        "--max-model-len",
        "256",
        "--kv-cache-memory",
        "16MiB",
        "--served-model-name",
        "base",
        "--shutdown-timeout",
        "1",
        "--structured-outputs-compile-timeout",
        "600",
    ]
    with ServeProcess(flags) as process:
        leaving = _send(process, RUNAWAY)
        wait_for(lambda: _metric(process, "grammar_compiles_running") == 1, 60, "its compile to start")
        leaving.close()
        wait_for(
            lambda: _metric(process, "grammar_compiles_cancelled_total") == 1, 10, "the compile withdrawn"
        )
        wait_for(lambda: _metric(process, "grammar_compiles_running") == 0, 10, "its worker killed")
        # Both from one client (one peer, no keys): one compiles, the other waits for its share.
        staying = [_send(process, RUNAWAY + "c" * i) for i in range(2)]
        wait_for(
            lambda: (
                _metric(process, "grammar_compiles_running") == 1
                and _metric(process, "grammar_compiles_queued") == 1
            ),
            60,
            "one compile running, one queued",
        )
        start = time.monotonic()
        status, output = process.stop(signal.SIGTERM, timeout_s=30)
        elapsed = time.monotonic() - start
        for sock in staying:
            sock.close()
    assert status == 0, output
    assert elapsed < 1 + 10, (elapsed, output)
    assert "Traceback" not in output, output
