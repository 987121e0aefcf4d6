"""Client-supplied names and paths (fake engine): a lone surrogate, a control character, a bidi override
or an absurd length in `lora_name`, `lora_path` or a request's `model` is a 400 that does not echo the
text, before anything is registered, logged or counted, so /v1/models and /metrics keep working."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from support.fake_engine import FakeEngine, write_adapter
from support.harness import RunningServer

from loraserve.entrypoints.openai.api_server import ServerOptions

BAD_NAMES = {
    "surrogate": "p12\ud800",
    "newline": "p12\nINFO forged log line",
    "carriage_return": "p12\rforged",
    "nul": "p12\x00",
    "escape": "p12\x1b[31mred",
    "bidi_override": "p12\u202egnp.exe",
    "line_separator": "p12\u2028forged",
    "too_long": "p" * 257,
}


@pytest.fixture(scope="module")
def names_server(tokenizer, tmp_path_factory: pytest.TempPathFactory):
    adapter = write_adapter(str(tmp_path_factory.mktemp("names") / "good"))
    engine = FakeEngine(tokenizer)
    options = ServerOptions(served_model_names=["base"], allow_runtime_lora_updating=True)
    with RunningServer(engine, options) as running:
        assert load(running, "good", adapter).status_code == 200
        yield running, adapter


def post(server: RunningServer, path: str, body: dict) -> httpx.Response:
    # json.dumps escapes a lone surrogate as \ud800: valid JSON that decodes back to the surrogate.
    return server.http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})


def load(server: RunningServer, name: str, path: str) -> httpx.Response:
    return post(server, "/v1/load_lora_adapter", {"lora_name": name, "lora_path": path})


def assert_refused(response: httpx.Response, param: str, bad: str) -> None:
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["code"] == 400
    tail = bad[3:]  # whatever follows "p12"
    assert tail[:10] not in error["message"] and bad not in error["message"]


def assert_monitoring_works(server: RunningServer) -> None:
    models = server.http.get("/v1/models")
    assert models.status_code == 200 and {c["id"] for c in models.json()["data"]} == {"base", "good"}
    assert server.http.get("/metrics").status_code == 200


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_bad_lora_name_is_refused_before_registering(names_server, case: str) -> None:
    server, adapter = names_server
    assert_refused(load(server, BAD_NAMES[case], adapter), "lora_name", BAD_NAMES[case])
    response = post(server, "/v1/unload_lora_adapter", {"lora_name": BAD_NAMES[case]})
    assert_refused(response, "lora_name", BAD_NAMES[case])
    assert_monitoring_works(server)


@pytest.mark.parametrize("case", ["surrogate", "newline", "nul", "escape", "bidi_override"])
def test_bad_lora_path_is_refused_before_logging(names_server, case: str, caplog: pytest.LogCaptureFixture) -> None:
    server, adapter = names_server
    bad_path = adapter + BAD_NAMES[case][3:]
    with caplog.at_level(logging.DEBUG):
        response = load(server, "other", bad_path)
    assert_refused(response, "lora_path", bad_path)
    assert "forged" not in caplog.text and adapter not in response.text
    assert_monitoring_works(server)


def test_very_long_lora_path_is_a_400_without_the_path(names_server) -> None:
    server, adapter = names_server
    response = load(server, "long", adapter + "/" + "a" * 10_000)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == "lora_path" and "too long" in error["message"]
    assert "aaaaaaaaaa" not in response.text and adapter not in response.text


@pytest.mark.parametrize("case", list(BAD_NAMES))
def test_bad_model_is_one_400_and_at_most_one_short_log_line(
    names_server, case: str, caplog: pytest.LogCaptureFixture
) -> None:
    server, _ = names_server
    for path, body in (
        ("/v1/completions", {"prompt": "hi", "max_tokens": 2}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}),
    ):
        caplog.clear()
        with caplog.at_level(logging.DEBUG):
            response = post(server, path, {"model": BAD_NAMES[case], **body})
        assert_refused(response, "model", BAD_NAMES[case])
        # The server's own lines: not the access log's one line per request, nor this test client's.
        records = [
            r for r in caplog.records if r.levelno >= logging.INFO and r.name not in ("uvicorn.access", "httpx")
        ]
        assert len(records) <= 1, [r.getMessage()[:200] for r in records]
        for record in records:
            message = record.getMessage()
            assert record.exc_info is None and len(message) < 300 and "\n" not in message
        assert_monitoring_works(server)
