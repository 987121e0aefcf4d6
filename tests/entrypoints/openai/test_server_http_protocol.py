"""The HTTP protocol edges over a real uvicorn server and the fake engine: a refused body still gets
its 413 (drained, never a connection reset), HTTP versions other than 1.0/1.1 get a 505, and `/health`
answers HEAD as well as GET."""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from support.fake_engine import FakeEngine
from support.harness import RunningServer
from support.raw_http import raw_exchange, request_head

from loraserve.entrypoints.openai.server.api_server import ServerOptions

MiB = 1 << 20
JSON = {"Host": "x", "Content-Type": "application/json"}


@pytest.fixture(scope="module")
def default_limits(tokenizer) -> Any:
    """The default 4 MiB body limit, the one the issue's uploads ran into."""
    with RunningServer(FakeEngine(tokenizer), ServerOptions(served_model_names=["base"])) as server:
        assert server.options.max_request_body_bytes == 4 * MiB
        yield server


def _upload(size: int) -> bytes:
    """A completion body of exactly `size` bytes."""
    head = b'{"model": "base", "max_tokens": 2, "prompt": "'
    return head + b"x" * (size - len(head) - 2) + b'"}'


def _is_413(data: bytes) -> bool:
    head, _, body = data.partition(b"\r\n\r\n")
    if not head.startswith(b"HTTP/1.1 413 "):
        return False
    error = json.loads(body)["error"]
    return (
        error["code"] == 413
        and error["type"] == "RequestTooLargeError"
        and "4194304 bytes" in error["message"]
    )


def test_a_body_sent_in_one_go_gets_its_413(default_limits: RunningServer) -> None:
    """The issue's raw-socket case: head and 5 MiB body in one write, then read. A server that closes
    with the body unread resets the connection; this one reads and drops the rest first."""
    body = _upload(5 * MiB)
    data = request_head("POST", "/v1/completions", {**JSON, "Content-Length": str(len(body))}) + body
    replies = [raw_exchange(default_limits.port, data) for _ in range(10)]
    outcomes = [("reset" if r.reset else "") + r.data[:12].decode("latin-1") for r in replies]
    assert sum(not r.reset and _is_413(r.data) for r in replies) == 10, outcomes
    assert default_limits.http.get("/health").status_code == 200


def test_chunked_body_past_the_limit_gets_its_413(default_limits: RunningServer) -> None:
    """No Content-Length: counted as it arrives, refused past 4 MiB, the rest read and dropped."""
    chunk = b"x" * MiB
    chunked = b"".join(b"%x\r\n%s\r\n" % (len(chunk), chunk) for _ in range(6)) + b"0\r\n\r\n"
    data = request_head("POST", "/v1/completions", {**JSON, "Transfer-Encoding": "chunked"}) + chunked
    replies = [raw_exchange(default_limits.port, data) for _ in range(5)]
    assert sum(not r.reset and _is_413(r.data) for r in replies) == 5, [r.data[:12] for r in replies]


def test_httpx_uploads_get_their_413(default_limits: RunningServer) -> None:
    """The issue's httpx case (1 in 20 was a reset): 20 uploads of 5 MiB, 20 answers of 413."""
    body = _upload(5 * MiB)
    statuses = []
    with httpx.Client(base_url=default_limits.url, timeout=30) as client:
        for _ in range(20):
            try:
                statuses.append(client.post("/v1/completions", content=body, headers=JSON).status_code)
            except httpx.TransportError as exc:
                statuses.append(type(exc).__name__)
    assert statuses == [413] * 20


def test_a_body_past_what_the_drain_reads_is_refused_at_once(default_limits: RunningServer) -> None:
    """A declared 1 GiB is not read (the drain stops at 4x the limit): the 413 comes without the body."""
    head = request_head("POST", "/v1/completions", {**JSON, "Content-Length": str(1 << 30)})
    reply = raw_exchange(default_limits.port, head + b'{"model": ', timeout=10)
    assert _is_413(reply.data), reply


def test_expect_continue_gets_the_413_without_a_100(default_limits: RunningServer) -> None:
    """A client waiting for `100 Continue` never sends the body: the refusal comes at once, no 100."""
    headers = {**JSON, "Content-Length": str(5 * MiB), "Expect": "100-continue"}
    reply = raw_exchange(default_limits.port, request_head("POST", "/v1/completions", headers), timeout=10)
    assert _is_413(reply.data) and b"100 Continue" not in reply.data, reply


@pytest.mark.parametrize("version", ["9.9", "2.0", "1.2", "0.9"])
def test_http_versions_other_than_1_0_and_1_1_get_505(default_limits: RunningServer, version: str) -> None:
    reply = raw_exchange(default_limits.port, request_head("GET", "/health", {"Host": "x"}, version))
    assert reply.status == 505 and not reply.reset, reply
    error = reply.json()["error"]
    assert error["code"] == 505 and error["type"] == "HTTPVersionNotSupportedError"
    assert f"HTTP/{version} is not supported" in error["message"]
    # A valid request padded to 300 kB: answered with the 505, drained, and never run.
    body = json.dumps({"model": "base", "prompt": "x", "max_tokens": 2}).encode() + b" " * 300_000
    post = request_head("POST", "/v1/completions", {**JSON, "Content-Length": str(len(body))}, version)
    before = len(default_limits.engine.prompts_seen)
    replies = [raw_exchange(default_limits.port, post + body) for _ in range(3)]
    assert [(r.status, r.reset) for r in replies] == [(505, False)] * 3
    assert len(default_limits.engine.prompts_seen) == before


@pytest.mark.parametrize("version", ["1.0", "1.1"])
def test_http_1_0_and_1_1_are_served(default_limits: RunningServer, version: str) -> None:
    headers = {"Host": "x", "Connection": "close"}
    reply = raw_exchange(default_limits.port, request_head("GET", "/health", headers, version))
    assert reply.status == 200, reply


def test_the_version_check_comes_before_the_api_key(tokenizer) -> None:
    options = ServerOptions(served_model_names=["base"], api_keys=["sk-key"])
    with RunningServer(FakeEngine(tokenizer), options) as server:
        headers = {"Host": "x", "Connection": "close"}
        assert raw_exchange(server.port, request_head("GET", "/v1/models", headers, "9.9")).status == 505
        assert raw_exchange(server.port, request_head("GET", "/v1/models", headers)).status == 401


def test_head_on_health(default_limits: RunningServer) -> None:
    reply = default_limits.http.head("/health")
    assert reply.status_code == 200 and reply.content == b""
    assert default_limits.http.head("/v1/models").status_code == 405  # only /health takes HEAD


def test_head_on_health_of_a_dead_engine_is_500(tokenizer) -> None:
    with RunningServer(FakeEngine(tokenizer), ServerOptions(served_model_names=["base"])) as server:
        server.call(lambda: server.engine.kill(RuntimeError("the forward pass failed")))
        reply = server.http.head("/health")
        assert reply.status_code == 500 and reply.content == b""
        assert server.http.get("/health").json()["error"]["code"] == 500
