"""Fair admission and tokenization through the server (issue 22, items 2 and 3).

- One request may hold at most `--max-queued-share` of the queue (the issue's 169-byte request of
  1,024 sequences is a 400 naming the flag), one API key's requests together too: while one client
  loops queue-filling requests, another's short requests are admitted and the big ones still complete
  (the real engine; successes and 503s are counted, no wall clock is asserted).
- A request that finds the queue full waits for room instead of an instant 503.
- A huge text that cannot fit is refused from a bounded count, not tokenized in full (the characters
  handed to the tokenizer are counted), on either endpoint.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import httpx
import pytest
from support.fake_engine import FakeEngine, hold_generation, release_generation
from support.harness import RunningServer, wait_for

from loraserve.config import SchedulerConfig
from loraserve.engine.tokenization import PROBE_CHUNK_CHARS, max_chars_per_token
from loraserve.entrypoints.openai.server.api_server import ServerOptions

KEYS = ["key-of-the-looping-client", "key-of-the-short-client"]


def _error(response: httpx.Response, status: int) -> dict:
    assert response.status_code == status, response.text
    return response.json()["error"]


def test_the_issue_request_is_400_beyond_one_requests_share(server: RunningServer) -> None:
    body = {"model": "base", "prompt": [[5, 6, 7]] * 8, "n": 128, "max_tokens": 300, "ignore_eos": True}
    error = _error(server.http.post("/v1/completions", json=body), 400)
    assert "1024 sequences" in error["message"] and "--max-queued-share 0.5" in error["message"]
    assert not server.engine.running


def test_a_request_finding_the_queue_full_waits_for_room(tokenizer: Any) -> None:
    config = SchedulerConfig(max_num_queued_reqs=2, queue_wait_timeout_s=120)  # share: 1 each
    engine = FakeEngine(tokenizer, scheduler_config=config)
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as server:
        hold_generation(server)
        statuses: list[int] = []

        def post() -> None:
            body = {"model": "base", "prompt": [5, 6], "max_tokens": 2}
            statuses.append(httpx.post(server.url + "/v1/completions", json=body, timeout=120).status_code)

        threads = [threading.Thread(target=post) for _ in range(3)]
        for thread in threads:
            thread.start()
        try:
            wait_for(lambda: len(engine.running) == 2, what="two requests to fill the queue")
            wait_for(
                lambda: engine._admission is not None and engine._admission.num_waiting == 1, what="a waiter"
            )
            assert len(engine.running) == 2  # the third waits at the gate, not in the engine
        finally:
            release_generation(server)
            for thread in threads:
                thread.join(120)
        assert statuses == [200, 200, 200]
        assert engine._admission is not None and engine._admission.num_timed_out == 0


def test_api_keys_name_the_client_never_the_key(tokenizer: Any) -> None:
    engine = FakeEngine(tokenizer)
    with RunningServer(engine, ServerOptions(served_model_names=["base"], api_keys=KEYS)) as server:
        for key in reversed(KEYS):
            body = {"model": "base", "prompt": [5, 6], "max_tokens": 1}
            response = server.http.post(
                "/v1/completions", json=body, headers={"Authorization": f"Bearer {key}"}
            )
            assert response.status_code == 200, response.text
    assert engine.admitted_clients == ["key-1", "key-0"]


class _CountingTokenizer:
    """The real tokenizer, counting the characters it is asked to encode."""

    def __init__(self, inner: Any) -> None:
        self._inner = inner
        self.chars = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def __len__(self) -> int:
        return len(self._inner)

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.chars += len(text)
        return list(self._inner.encode(text, **kwargs))


def _post_text(server: RunningServer, endpoint: str, text: str) -> httpx.Response:
    if endpoint == "completions":
        return server.http.post("/v1/completions", json={"model": "base", "prompt": text, "max_tokens": 5})
    body = {"model": "base", "messages": [{"role": "user", "content": text}]}
    return server.http.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_a_huge_text_is_refused_without_tokenizing_it_whole(tokenizer: Any, endpoint: str) -> None:
    counting = _CountingTokenizer(tokenizer)
    engine = FakeEngine(counting, max_model_len=2048)
    sentence = "The adapter serves tokens to every client in turn. "
    with RunningServer(engine, ServerOptions(served_model_names=["base"])) as server:
        # Beyond max_model_len x the longest vocabulary entry: refused from its length alone.
        error = _error(_post_text(server, endpoint, sentence * 20_000), 400)  # 1 M characters
        assert error["message"].startswith("This model's maximum context length is 2048 tokens.")
        assert counting.chars == 0
        # Shorter than that, but far beyond 2048 tokens: refused from a count of its first pieces.
        text = sentence * (max_chars_per_token(tokenizer) * 2048 // len(sentence) - 1)
        error = _error(_post_text(server, endpoint, text), 400)
        assert error["message"].startswith(
            "This model's maximum context length is 2048 tokens. However, your"
        )
        assert "at least" in error["message"]
        assert 0 < counting.chars <= PROBE_CHUNK_CHARS < len(text) // 3  # one piece, not the whole
        counting.chars = 0
        short = {"model": "base", "prompt": "Hello", "max_tokens": 5}
        assert server.http.post("/v1/completions", json=short).status_code == 200
        assert counting.chars == len("Hello")  # a short text is tokenized once, whole
    assert not engine.running


@pytest.fixture(scope="module")
def real_server(tiny_model: Any):
    """The real engine behind a server with two API keys: 16 sequences queue, 8 per key or request."""
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=tiny_model("llama"), dtype="float32", max_num_queued_reqs=16, queue_wait_timeout_s=0)
    )
    with RunningServer(engine, ServerOptions(served_model_names=["base"], api_keys=KEYS)) as server:
        yield server


def test_short_requests_are_admitted_while_another_key_loops_queue_filling_requests(real_server) -> None:
    """Client A sends requests of its whole share (8 sequences) from two threads in a loop, retrying
    its 503s: unchecked, two of them would fill the queue. Client B's short requests, sent while A
    runs, are all admitted at once (the wait is 0, so any lack of room would be a 503), and every
    one of A's requests completes."""
    url = real_server.url + "/v1/completions"
    big = {"model": "base", "prompt": [[5, 6, 7]] * 2, "n": 4, "max_tokens": 24, "ignore_eos": True}
    short = {"model": "base", "prompt": [9, 10, 11], "max_tokens": 2, "ignore_eos": True}
    a_done: list[int] = []
    a_refused: list[int] = []

    def loop_a() -> None:
        with httpx.Client(headers={"Authorization": f"Bearer {KEYS[0]}"}, timeout=120) as http:
            for _ in range(300):  # bounded: at most this many tries for its 3 requests
                if len([s for s in a_done if s == threading.get_ident()]) == 3:
                    return
                response = http.post(url, json=big)
                if response.status_code == 503:  # its own share is taken: retry shortly, as told
                    a_refused.append(1)
                    time.sleep(0.05)
                    continue
                assert response.status_code == 200, response.text
                assert len(response.json()["choices"]) == 8
                a_done.append(threading.get_ident())

    threads = [threading.Thread(target=loop_a) for _ in range(2)]
    for thread in threads:
        thread.start()
    b_statuses: list[int] = []
    with httpx.Client(headers={"Authorization": f"Bearer {KEYS[1]}"}, timeout=120) as http:
        while any(thread.is_alive() for thread in threads) or len(b_statuses) < 3:
            b_statuses.append(http.post(url, json=short).status_code)
            if len(b_statuses) >= 200:
                break
    for thread in threads:
        thread.join(120)
    assert len(a_done) == 6  # the big ones are served, none starved
    assert b_statuses and set(b_statuses) == {200}, b_statuses.count(503)
    stats = real_server.call(
        lambda: (real_server.engine.admission.total.num_seqs, real_server.engine.admission.num_waiting)
    )
    assert stats == (0, 0)  # every hold was given back
