"""Client-supplied names and paths (fake engine): a lone surrogate, a control character, a bidi override
or an absurd length in `lora_name`, `lora_path` or a request's `model` is a 400 that does not echo the
text, before anything is registered, logged or counted, so /v1/models and /metrics keep working.
Look-alike names: NFKC-equal spellings are one adapter, a Cyrillic or Greek look-alike is a 400."""

from __future__ import annotations

import json
import logging

import httpx
import pytest
from support.fake_engine import FakeEngine, write_adapter
from support.harness import RunningServer

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.lora.request import LoRARequest
from loraserve.lora.resolver import LoRAResolverRegistry
from loraserve.lora.resolvers.filesystem_resolver import FilesystemResolver

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
def test_bad_lora_path_is_refused_before_logging(
    names_server, case: str, caplog: pytest.LogCaptureFixture
) -> None:
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
            r
            for r in caplog.records
            if r.levelno >= logging.INFO and r.name not in ("uvicorn.access", "httpx")
        ]
        assert len(records) <= 1, [r.getMessage()[:200] for r in records]
        for record in records:
            message = record.getMessage()
            assert record.exc_info is None and len(message) < 300 and "\n" not in message
        assert_monitoring_works(server)


# Look-alike names (issue 22): NFKC-equal spellings are one name; a Cyrillic or Greek look-alike of a
# registered name is refused. Each case with its own server, since each registers names.
NFC_CAFE, NFD_CAFE = "caf\u00e9", "cafe\u0301"
FULLWIDTH_SQL, CYRILLIC_SQL = "\uff53\uff51\uff4c", "\u0455ql"


class AskedResolver(FilesystemResolver):
    """The filesystem resolver, recording every name it is asked for."""

    def __init__(self, root: str) -> None:
        super().__init__(root)
        self.asked: list[str] = []

    async def resolve_lora(self, base_model_name: str, lora_name: str) -> LoRARequest | None:
        self.asked.append(lora_name)
        return await super().resolve_lora(base_model_name, lora_name)


@pytest.fixture()
def alike_server(tokenizer, tmp_path):
    for name in ("sql", CYRILLIC_SQL, "b\u0430se"):  # folders the resolver would find
        write_adapter(str(tmp_path / name))
    resolver = AskedResolver(str(tmp_path))
    saved = dict(LoRAResolverRegistry.resolvers)
    LoRAResolverRegistry.resolvers.clear()
    LoRAResolverRegistry.register_resolver("counting", resolver)
    engine = FakeEngine(tokenizer)
    try:
        with RunningServer(
            engine, ServerOptions(served_model_names=["base"], allow_runtime_lora_updating=True)
        ) as running:
            yield running, engine, resolver, str(tmp_path / "sql")
    finally:
        LoRAResolverRegistry.resolvers.clear()
        LoRAResolverRegistry.resolvers.update(saved)


def _text(server: RunningServer, model: str) -> str:
    response = post(
        server, "/v1/completions", {"model": model, "prompt": "hi", "max_tokens": 4, "temperature": 0}
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def test_nfc_and_nfd_spellings_are_one_adapter(alike_server) -> None:
    server, engine, _, adapter = alike_server
    assert load(server, NFD_CAFE, adapter).status_code == 200  # registered under its NFC form
    again = load(server, NFC_CAFE, adapter)
    assert again.status_code == 400 and "has already been loaded" in again.json()["error"]["message"]
    assert {c["id"] for c in server.http.get("/v1/models").json()["data"]} == {"base", NFC_CAFE}
    assert _text(server, NFD_CAFE) == _text(server, NFC_CAFE) != _text(server, "base")
    assert engine.add_lora_calls == [NFC_CAFE]
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": NFD_CAFE}).status_code == 200
    assert {c["id"] for c in server.http.get("/v1/models").json()["data"]} == {"base"}


def test_fullwidth_is_the_same_name_and_requests_resolve_to_it(alike_server) -> None:
    server, engine, resolver, adapter = alike_server
    assert load(server, "sql", adapter).status_code == 200
    again = load(server, FULLWIDTH_SQL, adapter)
    assert again.status_code == 400 and "'sql' has already been loaded" in again.json()["error"]["message"]
    assert _text(server, FULLWIDTH_SQL) == _text(server, "sql")
    assert engine.add_lora_calls == ["sql"] and resolver.asked == []


def test_a_cyrillic_look_alike_is_refused_by_load_and_by_resolution(alike_server) -> None:
    server, engine, resolver, adapter = alike_server
    assert load(server, "sql", adapter).status_code == 200
    for response, param in (
        (load(server, CYRILLIC_SQL, adapter), "lora_name"),
        (post(server, "/v1/completions", {"model": CYRILLIC_SQL, "prompt": "hi", "max_tokens": 2}), "model"),
    ):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == param
        assert "'\\u0455ql' looks like the loaded adapter 'sql'" in error["message"]
    assert resolver.asked == [] and engine.add_lora_calls == ["sql"]  # refused before any lookup
    # Once 'sql' is gone the other spelling is a name of its own again (here: found by the resolver).
    assert post(server, "/v1/unload_lora_adapter", {"lora_name": "sql"}).status_code == 200
    assert _text(server, CYRILLIC_SQL) and engine.add_lora_calls == ["sql", CYRILLIC_SQL]
    assert load(server, "sql", adapter).status_code == 400


def test_names_like_the_base_model(alike_server) -> None:
    server, engine, resolver, adapter = alike_server
    fullwidth = load(server, "\uff42\uff41\uff53\uff45", adapter)
    assert fullwidth.status_code == 400 and "is the name of a served base model" in fullwidth.text
    cyrillic = load(server, "b\u0430se", adapter)
    assert cyrillic.status_code == 400 and "looks like the served base model 'base'" in cyrillic.text
    assert _text(server, "\uff42\uff41\uff53\uff45") == _text(server, "base")
    resolved = post(server, "/v1/completions", {"model": "b\u0430se", "prompt": "hi", "max_tokens": 2})
    assert resolved.status_code == 400 and resolver.asked == [] and engine.add_lora_calls == []


def test_a_name_that_nfkc_lengthens_past_the_limit_is_refused(alike_server) -> None:
    server, _, _, adapter = alike_server
    name = "\ufdfa" * 20  # one character, 18 once NFKC-normalised: 360
    response = load(server, name, adapter)
    assert response.status_code == 400 and "too long" in response.json()["error"]["message"]
