"""Shutdown: running requests drain within --shutdown-timeout, then end with a 503 (a stream: an error
event and [DONE]); a draining server takes no new work; a real SIGTERM exits 0 without tracebacks."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
from support.fake_engine import FakeEngine, hold_generation, release_generation
from support.harness import RunningServer, stream_events_into, wait_for
from support.serve_process import ServeProcess

from loraserve.entrypoints.openai.server.api_server import ServerOptions

STREAM = {"model": "base", "prompt": "abc", "max_tokens": 5, "stream": True}


def test_running_requests_finish_within_the_timeout(tokenizer) -> None:
    server = RunningServer(
        FakeEngine(tokenizer), ServerOptions(served_model_names=["base"], shutdown_timeout_s=60)
    )
    with server:
        hold_generation(server, num_free_tokens=1)
        events: list[Any] = []
        client = threading.Thread(target=stream_events_into, args=(server.url, STREAM, events))
        client.start()
        wait_for(lambda: len(server.engine.running) == 1, what="the stream to start")
        server.begin_shutdown()
        wait_for(lambda: server.app.state.lifecycle.is_draining, what="the drain to begin")
        release_generation(server)
        client.join(60)
        server.thread.join(60)  # the server stops once the stream is done, not after 60 s
        assert not server.thread.is_alive()
    assert events[0] == 200 and events[-1] == "[DONE]"
    assert not any("error" in e for e in events[1:-1] if isinstance(e, dict))
    assert "".join(e["choices"][0]["text"] for e in events[1:-1]) != ""


def test_requests_past_the_timeout_end_with_503(tokenizer) -> None:
    server = RunningServer(
        FakeEngine(tokenizer), ServerOptions(served_model_names=["base"], shutdown_timeout_s=0.2)
    )
    with server:
        hold_generation(server, num_free_tokens=1)
        events: list[Any] = []
        plain: dict[str, Any] = {}

        def complete() -> None:
            body = {"model": "base", "prompt": "xyz", "max_tokens": 5}
            response = httpx.post(server.url + "/v1/completions", json=body, timeout=60)
            plain.update(status=response.status_code, body=response.json())

        clients = [
            threading.Thread(target=stream_events_into, args=(server.url, STREAM, events)),
            threading.Thread(target=complete),
        ]
        for thread in clients:
            thread.start()
        wait_for(lambda: len(server.engine.running) == 2, what="both requests to start")
        server.begin_shutdown()  # the gate is never released: only the timeout ends them
        for thread in clients:
            thread.join(60)
        server.thread.join(60)
    assert events[0] == 200 and events[-1] == "[DONE]"
    assert events[-2]["error"]["code"] == 503 and "shutting down" in events[-2]["error"]["message"]
    assert plain["status"] == 503 and plain["body"]["error"]["type"] == "ServiceUnavailableError"


def test_a_draining_server_refuses_new_work(server: RunningServer) -> None:
    lifecycle = server.app.state.lifecycle
    server.call(lambda: setattr(lifecycle, "is_draining", True))
    try:
        health = server.http.get("/health")
        completion = server.http.post(
            "/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2}
        )
        assert server.http.get("/metrics").status_code == 200  # still observable while it drains
    finally:
        server.call(lambda: setattr(lifecycle, "is_draining", False))
    for response in (health, completion):
        assert response.status_code == 503 and "shutting down" in response.json()["error"]["message"]


def test_sigterm_mid_stream_exits_cleanly(tiny_model: Any) -> None:
    """A real process: SIGTERM while a long stream runs. The stream ends with [DONE] (finished, or a
    503 error event if it outlived the timeout), the process exits 0, and nothing logs a traceback."""
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
        "0.5",
    ]
    with ServeProcess(flags) as server:
        events: list[Any] = []
        body = {"model": "base", "prompt": "abc", "max_tokens": 250, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as response:
            lines = response.iter_lines()
            first = next(lines)
            assert first.startswith("data: ")
            server.process.send_signal(15)
            for line in lines:
                if line.startswith("data: "):
                    data = line[len("data: ") :]
                    events.append(data if data == "[DONE]" else json.loads(data))
        status, output = server.stop()
    assert events and events[-1] == "[DONE]"
    errors = [e["error"] for e in events[:-1] if "error" in e]
    assert all(error["code"] == 503 for error in errors) and len(errors) <= 1
    assert status == 0, output
    assert "Traceback" not in output and "Shutting down" in output
