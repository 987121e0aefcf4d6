"""Bounded work over a real uvicorn server and the fake engine: per-request caps, admission control,
body size and read deadlines, and nothing slow on the event loop."""

from __future__ import annotations

import json
import socket
import threading
from typing import Any

import httpx
import pytest
from support.fake_engine import FakeEngine
from support.harness import RunningServer

from loraserve.config import SchedulerConfig
from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.errors import EngineOverloadedError


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
    return error


def test_prompts_times_n_beyond_the_queue_is_400(server: RunningServer) -> None:
    """The issue's request: 300 prompts x n=128 = 38,400 sequences, more than the queue ever holds."""
    body = {"model": "base", "prompt": [[5, 6, 7]] * 300, "n": 128, "max_tokens": 16}
    error = _error(server.http.post("/v1/completions", json=body), 400)
    assert "38400 sequences" in error["message"] and "--max-num-queued-reqs" in error["message"]
    assert not server.engine.running


def test_prompt_tokens_beyond_the_queue_is_400(tokenizer) -> None:
    engine = FakeEngine(tokenizer, scheduler_config=SchedulerConfig(max_num_queued_tokens=20, max_queued_share=1))
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as server:
        body = {"model": "base", "prompt": [[5, 6, 7, 8, 9]] * 2, "n": 3, "max_tokens": 2}
        error = _error(server.http.post("/v1/completions", json=body), 400)
        assert "30 prompt tokens" in error["message"] and "--max-num-queued-tokens" in error["message"]
        body["n"] = 2
        assert server.http.post("/v1/completions", json=body).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_full_queue_is_503_with_retry_after(server: RunningServer, stream: bool) -> None:
    server.call(lambda: setattr(server.engine, "fail_with", EngineOverloadedError("The server is busy.", 2)))
    body = {"model": "base", "prompt": "x", "max_tokens": 2, "stream": stream}
    response = server.http.post("/v1/completions", json=body)
    error = _error(response, 503)
    assert response.headers["retry-after"] == "2" and "busy" in error["message"]
    assert server.http.post("/v1/completions", json=body).status_code == 200  # the next one fits


@pytest.mark.parametrize(
    "stop",
    [["s"] * 65, "x" * 1025, ["x" * 1025]],
    ids=["too-many", "too-long", "too-long-in-list"],
)
def test_stop_string_caps(server: RunningServer, stop: Any) -> None:
    body = {"model": "base", "prompt": "x", "max_tokens": 2, "stop": stop}
    error = _error(server.http.post("/v1/completions", json=body), 400)
    assert error["param"].split(".")[0] == "stop" and "more problem" not in error["message"]
    body["stop"] = ["s"] * 64
    assert server.http.post("/v1/completions", json=body).status_code == 200


def test_text_too_long_for_any_tokenization_is_400_untokenized(server: RunningServer) -> None:
    """A prompt with more characters than max_model_len tokens can cover is refused without tokenizing."""
    calls = []
    tokenizer = server.engine.tokenizer
    original = tokenizer.encode
    tokenizer.encode = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        body = {"model": "base", "prompt": "word " * 200_000, "max_tokens": 2}
        error = _error(server.http.post("/v1/completions", json=body), 400)
        chat = {"model": "base", "messages": [{"role": "user", "content": "word " * 200_000}]}
        chat_error = _error(server.http.post("/v1/chat/completions", json=chat), 400)
    finally:
        tokenizer.encode = original
    assert "maximum context length" in error["message"] and "characters" in error["message"]
    assert "characters" in chat_error["message"]
    assert calls == []


@pytest.fixture(scope="module")
def guarded(tokenizer) -> Any:
    options = ServerOptions(served_model_names=["base"], max_request_body_bytes=2000, request_read_timeout_s=0.5)
    with RunningServer(FakeEngine(tokenizer), options) as server:
        yield server


def test_body_over_the_limit_is_413(guarded: RunningServer) -> None:
    body = {"model": "base", "prompt": "x" * 3000, "max_tokens": 2}
    error = _error(guarded.http.post("/v1/completions", json=body), 413)
    assert "2000 bytes" in error["message"]
    # Chunked, so no Content-Length announces it: counted as it arrives.
    data = json.dumps(body).encode()
    chunks = (data[i : i + 500] for i in range(0, len(data), 500))
    response = httpx.post(guarded.url + "/v1/completions", content=chunks, headers={"content-type": "application/json"})
    _error(response, 413)
    assert guarded.http.post("/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 2}).status_code == 200


def _raw_exchange(port: int, data: bytes) -> bytes:
    """Send `data`, then read until the server closes the connection (the test's own bound: 30 s)."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as conn:
        conn.sendall(data)
        received = b""
        while chunk := conn.recv(65536):
            received += chunk
        return received


def test_trickling_body_gets_408(guarded: RunningServer) -> None:
    head = b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    reply = _raw_exchange(guarded.port, head + b'{"model": ')
    assert reply.startswith(b"HTTP/1.1 408 "), reply[:200]
    assert b"did not arrive within 0.5 s" in reply


@pytest.mark.parametrize("data", [b"", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n"], ids=["silent", "half-head"])
def test_connection_without_a_complete_head_is_closed(guarded: RunningServer, data: bytes) -> None:
    assert _raw_exchange(guarded.port, data) == b""  # closed by the server, nothing answered
    assert guarded.http.get("/health").status_code == 200


class _GatedTokenizer:
    """The test tokenizer, whose encode() blocks until the test releases it."""

    def __init__(self, tokenizer: Any) -> None:
        self._tokenizer = tokenizer
        self.entered = threading.Event()
        self.release = threading.Event()

    def encode(self, *args: Any, **kwargs: Any) -> Any:
        self.entered.set()
        assert self.release.wait(60)
        return self._tokenizer.encode(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def __len__(self) -> int:
        return len(self._tokenizer)


def test_tokenization_does_not_block_the_event_loop(tokenizer) -> None:
    gated = _GatedTokenizer(tokenizer)
    with RunningServer(FakeEngine(gated), ServerOptions(served_model_names=["base"])) as server:
        result: dict[str, int] = {}

        def post() -> None:
            body = {"model": "base", "prompt": "hello there", "max_tokens": 2}
            result["status"] = httpx.post(server.url + "/v1/completions", json=body, timeout=60).status_code

        thread = threading.Thread(target=post)
        thread.start()
        try:
            assert gated.entered.wait(60)
            # The tokenizer is busy with the request: every other endpoint still answers.
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            assert httpx.get(server.url + "/v1/models", timeout=30).status_code == 200
        finally:
            gated.release.set()
            thread.join(60)
        assert result["status"] == 200


def test_a_hundred_concurrent_requests_all_complete(server: RunningServer) -> None:
    """100 clients at once (half streaming, two models): every one gets its full, correct answer."""
    import asyncio

    from support.fake_server_fixtures import expected_ids

    async def one(client: httpx.AsyncClient, i: int) -> tuple[int, list[int], list[int]]:
        prompt_ids = [6 + i % 50, 7, 8]
        body = {"model": "base", "prompt": prompt_ids, "max_tokens": 4, "logprobs": 0,
                "return_tokens_as_token_ids": True}
        if i % 2:
            async with client.stream("POST", "/v1/completions", json={**body, "stream": True}) as response:
                lines = [line async for line in response.aiter_lines() if line.startswith("data: {")]
                tokens = [t for line in lines for c in json.loads(line[6:])["choices"] for t in c["logprobs"]["tokens"]]
                status = response.status_code
        else:
            response = await client.post("/v1/completions", json=body)
            status, tokens = response.status_code, response.json()["choices"][0]["logprobs"]["tokens"]
        return status, [int(t.split(":")[1]) for t in tokens], expected_ids(server, prompt_ids, 4)

    async def run() -> list[tuple[int, list[int], list[int]]]:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=60, limits=limits) as client:
            return await asyncio.gather(*(one(client, i) for i in range(100)))

    results = asyncio.run(run())
    assert all(status == 200 for status, _, _ in results)
    assert all(got == want for _, got, want in results)


def test_a_multi_prompt_request_is_admitted_whole_or_not_at_all(tokenizer) -> None:
    """With the queue nearly full, a 3-prompt request gets a 503 before any of its prompts starts."""
    from support.fake_engine import hold_generation, release_generation
    from support.harness import wait_for

    config = SchedulerConfig(max_num_queued_reqs=3, max_queued_share=1, queue_wait_timeout_s=0)
    engine = FakeEngine(tokenizer, scheduler_config=config)
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as server:
        hold_generation(server)
        result: dict[str, int] = {}
        first = threading.Thread(
            target=lambda: result.update(status=httpx.post(
                server.url + "/v1/completions", json={"model": "base", "prompt": [5, 6], "max_tokens": 2}, timeout=60
            ).status_code)
        )
        first.start()
        try:
            wait_for(lambda: len(engine.running) == 1, what="the first request to run")
            seen = len(engine.prompts_seen)
            body = {"model": "base", "prompt": [[7, 8], [9, 10], [11, 12]], "max_tokens": 2}
            response = server.http.post("/v1/completions", json=body)
            _error(response, 503)
            assert response.headers["retry-after"] == "1"
            assert len(engine.prompts_seen) == seen  # none of its prompts reached the engine
        finally:
            release_generation(server)
            first.join(60)
        assert result["status"] == 200
        assert server.http.post("/v1/completions", json=body).status_code == 200  # room again
