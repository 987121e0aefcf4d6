"""The SIGTERM drain as a load balancer sees it, over a real uvicorn server and the fake engine: while
requests run, new connections are still accepted and `/health` answers 503 (so the balancer stops
sending), new work gets 503, `/metrics` answers; once the running requests are done, the listening
socket closes."""

from __future__ import annotations

import json
import threading
from typing import Any

import httpx
import pytest
from support.fake_engine import FakeEngine, hold_generation, release_generation
from support.harness import RunningServer, stream_events_into, wait_for
from support.raw_http import raw_exchange, request_head

from loraserve.entrypoints.openai.server.api_server import ServerOptions

STREAM = {"model": "base", "prompt": "abc", "max_tokens": 5, "stream": True}


def _during_the_drain(url: str, port: int) -> dict[str, Any]:
    """What a balancer and its clients get on new connections while the server drains."""
    seen: dict[str, Any] = {}
    with httpx.Client(base_url=url, timeout=30) as fresh:  # its own connections, opened now
        seen["health"] = fresh.get("/health")
        seen["head"] = fresh.head("/health")
        seen["completion"] = fresh.post(
            "/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2}
        )
        seen["metrics"] = fresh.get("/metrics")
    body = json.dumps({"model": "base", "prompt": "x", "max_tokens": 2}).encode() + b" " * (3 << 20)
    head = request_head("POST", "/v1/completions", {"Host": "x", "Content-Length": str(len(body))})
    seen["upload"] = raw_exchange(port, head + body)  # refused, its 3 MiB read and dropped: no reset
    return seen


def test_the_drain_answers_new_connections_until_running_requests_finish(tokenizer) -> None:
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
        seen = _during_the_drain(server.url, server.port)
        assert server.thread.is_alive() and server.engine.running  # the stream still holds the drain open
        release_generation(server)
        client.join(60)
        server.thread.join(60)  # the server stops once the stream is done, not after 60 s
        assert not server.thread.is_alive()
        with pytest.raises(httpx.ConnectError):  # and then the listening socket is closed
            httpx.get(server.url + "/health", timeout=10)
    for name in ("health", "completion"):
        assert seen[name].status_code == 503 and "shutting down" in seen[name].json()["error"]["message"]
        assert seen[name].headers["connection"] == "close"
    assert seen["completion"].headers["retry-after"] == "1"
    assert seen["head"].status_code == 503 and seen["head"].content == b""
    assert seen["metrics"].status_code == 200
    assert seen["upload"].status == 503 and not seen["upload"].reset
    assert events[0] == 200 and events[-1] == "[DONE]"
    assert not any("error" in e for e in events[1:-1] if isinstance(e, dict))
    assert len(server.engine.prompts_seen) == 1  # nothing new ran during the drain


def test_a_drain_with_nothing_running_ends_at_once(tokenizer) -> None:
    """An idle server does not sit out its shutdown timeout (600 s here) before it stops."""
    server = RunningServer(
        FakeEngine(tokenizer), ServerOptions(served_model_names=["base"], shutdown_timeout_s=600)
    )
    with server:
        assert server.http.get("/health").status_code == 200  # an idle keep-alive connection stays open
        server.begin_shutdown()
        server.thread.join(60)
        assert not server.thread.is_alive()
    assert server.app.state.lifecycle.active_requests == 0
