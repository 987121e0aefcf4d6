"""Failure paths over a real uvicorn server and the fake engine: error statuses and shapes, failures that
stay with their request, client disconnects, the API key, a dead engine.

The oracle for every generated field is the engine itself: what the toy model yields for the same
prompt ids, parameters and adapter, which the HTTP layer must pass through unchanged.
"""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import openai
import pytest
from support.fake_engine import FakeEngine, hold_generation, release_generation
from support.fake_server_fixtures import expected_ids
from support.harness import RunningServer, wait_for

from loraserve.entrypoints.openai.server.api_server import ServerOptions

API_KEY = "sk-test-key"


@pytest.mark.parametrize(
    "body, status, param",
    [
        ({"model": "base", "prompt": "x", "n": 0}, 400, "n"),
        ({"model": "base", "prompt": "x", "temperature": -1}, 400, "temperature"),
        ({"model": "base", "prompt": "x", "top_p": 2}, 400, "top_p"),
        ({"model": "base", "prompt": "x", "max_tokens": 4, "min_tokens": 9}, 400, "min_tokens"),
        ({"model": "base", "prompt": [-1, 5]}, 400, None),
        ({"model": "base", "prompt": [10**6]}, 400, "prompt"),
        ({"model": "base", "prompt": "x " * 80}, 400, "prompt"),
        ({"model": "base", "prompt": "x", "max_tokens": 500}, 400, "max_tokens"),
        ({"model": "base", "prompt": []}, 400, None),
        ({"model": "nope", "prompt": "x"}, 404, "model"),
        ({"prompt": "x", "max_tokens": 1}, 200, None),
    ],
)
def test_completion_errors(server: RunningServer, body: dict, status: int, param: str | None) -> None:
    response = server.http.post("/v1/completions", json=body)
    assert response.status_code == status, response.text
    if status != 200:
        error = response.json()["error"]
        assert set(error) == {"message", "type", "param", "code"} and error["code"] == status
        if param is not None:
            assert error["param"] == param


@pytest.mark.parametrize("content", [b"[1, 2]", b'"text"', b"{not json", b""])
def test_body_not_a_json_object(server: RunningServer, content: bytes) -> None:
    for path in ("/v1/completions", "/v1/chat/completions"):
        response = server.http.post(path, content=content, headers={"content-type": "application/json"})
        assert response.status_code == 400 and response.json()["error"]["code"] == 400


def test_unknown_model_and_route(server: RunningServer, client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="missing", messages=[{"role": "user", "content": "hi"}])
    assert "The model `missing` does not exist." in str(info.value)
    response = server.http.get("/v1/nothing-here")
    assert response.status_code == 404 and response.json()["error"]["type"] == "NotFoundError"
    # Runtime updating is off: the adapter routes do not exist.
    response = server.http.post("/v1/load_lora_adapter", json={"lora_name": "a", "lora_path": "/tmp"})
    assert response.status_code == 404


def test_internal_error_hides_addresses(server: RunningServer, client: openai.OpenAI) -> None:
    server.call(
        lambda: setattr(server.engine, "fail_with", RuntimeError("bad state in <Foo object at 0x7f1234abcd>"))
    )
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="base", prompt="x", max_tokens=2)
    assert "0x7f" not in str(info.value.body) and "bad state" in str(info.value.body)
    assert client.completions.create(model="base", prompt="x", max_tokens=2).choices[0].text


def test_internal_os_error_hides_its_path(server: RunningServer, client: openai.OpenAI) -> None:
    error = PermissionError(13, "Permission denied", "/srv/adapters-cache/secret/adapter_model.safetensors")
    server.call(lambda: setattr(server.engine, "fail_with", error))
    with pytest.raises(openai.InternalServerError) as info:
        client.completions.create(model="base", prompt="x", max_tokens=2)
    assert "/srv" not in str(info.value.body) and "Permission denied" in str(info.value.body)


def test_stream_error_after_start(server: RunningServer) -> None:
    server.call(lambda: setattr(server.engine, "fail_after_tokens", 2))
    try:
        events = server.sse_events(
            "/v1/chat/completions",
            {
                "model": "base",
                "messages": [{"role": "user", "content": "hi"}],
                "max_tokens": 6,
                "stream": True,
            },
        )
    finally:
        server.call(lambda: setattr(server.engine, "fail_after_tokens", None))
    assert events[-1] == "[DONE]"
    error = events[-2]["error"]
    assert error["code"] == 500 and "0x7f" not in error["message"]
    assert sum(1 for e in events[:-2] if e["choices"] and e["choices"][0]["delta"].get("content")) == 2


def test_bad_requests_fail_alone(server: RunningServer, tokenizer) -> None:
    prompt_ids = tokenizer.encode("hello")
    want = tokenizer.decode(expected_ids(server, prompt_ids, 4))

    async def run() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.url, timeout=30) as http:
            good = {"model": "base", "prompt": "hello", "max_tokens": 4}
            bad = [
                {"model": "base", "prompt": "hello", "top_k": -5},
                {"model": "zzz", "prompt": "x"},
                {"prompt": [-3]},
            ]
            jobs = [http.post("/v1/completions", json=good if i % 2 else bad[i % 3]) for i in range(30)]
            return await asyncio.gather(*jobs)

    responses = asyncio.run(run())
    for i, response in enumerate(responses):
        if i % 2:
            assert response.status_code == 200 and response.json()["choices"][0]["text"] == want
        else:
            assert response.status_code in (400, 404)


@pytest.mark.parametrize("stream", [False, True])
def test_client_disconnect_aborts(server: RunningServer, stream: bool) -> None:
    hold_generation(server)
    server.engine.aborted_event.clear()
    try:
        before = len(server.engine.aborted)
        body = b'{"model": "base", "prompt": "abc", "max_tokens": 50, "stream": %s}' % (
            b"true" if stream else b"false"
        )
        conn = socket.create_connection(("127.0.0.1", server.port))
        conn.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            b"Content-Length: %d\r\n\r\n%s" % (len(body), body)
        )
        wait_for(lambda: len(server.engine.running) == 1, what="the request to start")
        conn.close()
        assert server.engine.aborted_event.wait(60)
        wait_for(lambda: not server.engine.running, what="the engine to drop the request")
        assert len(server.engine.aborted) == before + 1
    finally:
        release_generation(server)


def test_stream_disconnect_mid_stream_aborts(server: RunningServer) -> None:
    server.engine.aborted_event.clear()
    hold_generation(server, num_free_tokens=1)  # before the request: the stream stops after one token
    with httpx.stream(
        "POST",
        server.url + "/v1/completions",
        json={"model": "base", "prompt": "abc", "max_tokens": 50, "stream": True},
    ) as response:
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        wait_for(lambda: len(server.engine.running) == 1, what="the stream to be running")
    assert server.engine.aborted_event.wait(60)
    wait_for(lambda: not server.engine.running, what="the engine to drop the request")
    release_generation(server)


def test_api_key(tokenizer, adapter_dir: str) -> None:
    options = ServerOptions(served_model_names=["base"], api_keys=[API_KEY], allow_runtime_lora_updating=True)
    with RunningServer(FakeEngine(tokenizer), options) as server:
        routes = [
            ("GET", "/v1/models"),
            ("GET", "/version"),
            ("GET", "/metrics"),
            ("GET", "/openapi.json"),
            ("GET", "/docs"),
            ("POST", "/v1/completions"),
            ("POST", "/v1/chat/completions"),
            ("POST", "/v1/load_lora_adapter"),
            ("POST", "/v1/unload_lora_adapter"),
            ("GET", "/no-such-route"),
        ]
        for method, path in routes:
            for headers in (
                {},
                {"Authorization": "Bearer wrong"},
                {"Authorization": API_KEY},
                {"Authorization": f"bearer {API_KEY}"},
            ):
                response = server.http.request(method, path, headers=headers)
                assert response.status_code == 401, (method, path, headers)
                assert response.json()["error"]["code"] == 401
        assert server.http.get("/health").status_code == 200
        # /ping is vLLM's health check (SageMaker): open as /health is, GET and POST.
        assert server.http.get("/ping").status_code == server.http.post("/ping").status_code == 200
        for raw_path in (
            b"//v1/models",
            b"/health/../v1/models",
            b"/ping/../v1/models",
            b"/%68ealth",
            b"/v1/models?x=/health",
            b"/health/",
        ):
            conn = socket.create_connection(("127.0.0.1", server.port))
            conn.sendall(b"GET " + raw_path + b" HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            reply = conn.recv(4096)
            conn.close()
            assert reply.startswith(b"HTTP/1.1 401"), (raw_path, reply[:40])
        client = openai.OpenAI(base_url=server.url + "/v1", api_key=API_KEY, max_retries=0)
        assert [m.id for m in client.models.list().data] == ["base"]
        assert client.completions.create(model="base", prompt="hi", max_tokens=2).choices[0].text
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()


def test_dead_engine(tokenizer) -> None:
    with RunningServer(FakeEngine(tokenizer), ServerOptions(served_model_names=["base"])) as server:
        hold_generation(server)
        results: list[httpx.Response] = []
        worker = threading.Thread(
            target=lambda: results.append(
                server.http.post(
                    "/v1/completions",
                    json={"model": "base", "prompt": "x", "max_tokens": 5},
                    timeout=30,
                )
            )
        )
        worker.start()
        wait_for(lambda: len(server.engine.running) == 1, what="the request to run")
        server.call(
            lambda: server.engine.kill(RuntimeError("CUDA error: illegal memory access at 0xdeadbeef00"))
        )
        worker.join(30)
        assert results[0].status_code == 500 and "0xdeadbeef" not in results[0].text
        health = server.http.get("/health")
        assert health.status_code == 500 and health.json()["error"]["code"] == 500
        again = server.http.post("/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 5})
        assert again.status_code == 500


def test_api_key_and_drain_behind_a_root_path(tokenizer) -> None:
    """With --root-path, uvicorn prefixes every path: /health stays open, /metrics stays up while
    draining, and everything else still needs the key."""
    from loraserve.entrypoints.openai.server.api_server import build_app

    async def run() -> dict[str, int]:
        options = ServerOptions(served_model_names=["base"], api_keys=[API_KEY])
        app = await build_app(FakeEngine(tokenizer), options)
        transport = httpx.ASGITransport(app=app, root_path="/llm")
        key = {"Authorization": f"Bearer {API_KEY}"}
        async with httpx.AsyncClient(transport=transport, base_url="http://proxy") as client:
            seen = {
                "health": (await client.get("/llm/health")).status_code,
                "models": (await client.get("/llm/v1/models")).status_code,
                "models_key": (await client.get("/llm/v1/models", headers=key)).status_code,
            }
            app.state.lifecycle.is_draining = True
            seen["metrics_draining"] = (await client.get("/llm/metrics", headers=key)).status_code
            seen["models_draining"] = (await client.get("/llm/v1/models", headers=key)).status_code
        return seen

    assert asyncio.run(run()) == {
        "health": 200,
        "models": 401,
        "models_key": 200,
        "metrics_draining": 200,
        "models_draining": 503,
    }
