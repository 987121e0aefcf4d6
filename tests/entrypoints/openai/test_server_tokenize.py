"""vLLM's extra routes over a real server (fake engine): /tokenize, /detokenize, /tokenizer_info,
/ping, /invocations and /load, with the base model and an adapter, through httpx."""

from __future__ import annotations

import threading
from typing import Any

import openai
import pytest
from support.fake_engine import FakeEngine, hold_generation, release_generation
from support.harness import RunningServer, wait_for

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

MESSAGES = [{"role": "system", "content": "Be short."}, {"role": "user", "content": "Name a colour."}]


@pytest.mark.parametrize("model", ["base", "sql", None])
def test_tokenize_a_prompt_as_completions_would(server: RunningServer, tokenizer, model: str | None) -> None:
    body: dict[str, Any] = {"prompt": "The quick brown fox"}
    if model is not None:
        body["model"] = model
    reply = server.http.post("/tokenize", json=body)
    assert reply.status_code == 200, reply.text
    ids = tokenizer.encode("The quick brown fox")
    assert reply.json() == {"count": len(ids), "max_model_len": server.engine.max_model_len, "tokens": ids}
    plain = server.http.post(
        "/tokenize", json={**body, "add_special_tokens": False, "return_token_strs": True}
    )
    unspecial = tokenizer.encode("The quick brown fox", add_special_tokens=False)
    assert plain.json()["tokens"] == unspecial
    assert plain.json()["token_strs"] == tokenizer.convert_ids_to_tokens(unspecial)


def test_tokenize_messages_as_chat_would(server: RunningServer, tokenizer) -> None:
    reply = server.http.post("/tokenize", json={"model": "sql", "messages": MESSAGES})
    rendered = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    expected = tokenizer.encode(rendered, add_special_tokens=False)
    assert reply.status_code == 200 and reply.json()["tokens"] == expected
    # The ids chat completions send to the engine are the same.
    chat = server.http.post(
        "/v1/chat/completions", json={"model": "sql", "messages": MESSAGES, "max_tokens": 1}
    )
    assert chat.status_code == 200 and server.engine.prompts_seen[-1] == expected
    no_prompt = server.http.post("/tokenize", json={"messages": MESSAGES, "add_generation_prompt": False})
    closed = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=False)
    assert no_prompt.json()["tokens"] == tokenizer.encode(closed, add_special_tokens=False)
    tools = server.http.post("/tokenize", json={"messages": MESSAGES, "tools": [{"type": "function"}]})
    assert tools.status_code == 400 and tools.json()["error"]["param"].endswith("tools.0.function")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    with_tools = server.http.post("/tokenize", json={"messages": MESSAGES, "tools": [tool]})
    assert with_tools.status_code == 200, with_tools.text  # this template ignores tools
    assert with_tools.json()["tokens"] == expected
    both = server.http.post("/tokenize", json={"messages": MESSAGES, "continue_final_message": True})
    assert both.status_code == 400
    assert "Cannot set both `continue_final_message` and `add_generation_prompt` to True." in both.text


def test_detokenize_round_trips(server: RunningServer, tokenizer) -> None:
    ids = tokenizer.encode("hello world", add_special_tokens=False)
    for model in ("base", "sql"):
        reply = server.http.post("/detokenize", json={"model": model, "tokens": ids})
        assert reply.status_code == 200 and reply.json() == {"prompt": tokenizer.decode(ids)}
    bad = server.http.post("/detokenize", json={"tokens": [len(tokenizer) + 5]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_tokenizer_routes_check_the_model_name(server: RunningServer) -> None:
    for path, body in (("/tokenize", {"prompt": "x"}), ("/detokenize", {"tokens": [7]})):
        reply = server.http.post(path, json={**body, "model": "no-such-model"})
        assert reply.status_code == 404 and "no-such-model" in reply.json()["error"]["message"]


def test_ping_answers_like_health(server: RunningServer) -> None:
    assert server.http.get("/ping").status_code == 200
    assert server.http.post("/ping").status_code == 200


def test_invocations_dispatch_to_chat_and_completions(server: RunningServer) -> None:
    completion = {"model": "sql", "prompt": "hi there", "max_tokens": 3, "temperature": 0}
    chat = {"model": "base", "messages": MESSAGES, "max_tokens": 3, "temperature": 0}
    for body, path, kind in (
        (completion, "/v1/completions", "text_completion"),
        (chat, "/v1/chat/completions", "chat.completion"),
    ):
        via = server.http.post("/invocations", json=body)
        direct = server.http.post(path, json=body)
        assert via.status_code == 200 and via.json()["object"] == kind
        assert via.json()["choices"] == direct.json()["choices"] and via.json()["model"] == body["model"]
    odd = server.http.post("/invocations", json={"input": "embed me"})
    assert odd.status_code == 400
    assert "Cannot find suitable handler for request. Expected one of:" in odd.json()["error"]["message"]
    junk = server.http.post(
        "/invocations", content=b"{not json", headers={"content-type": "application/json"}
    )
    assert junk.status_code == 400 and "JSON decode error" in junk.json()["error"]["message"]


def test_the_tokenizer_info_route_needs_its_flag(server: RunningServer, tokenizer, adapter_dir: str) -> None:
    assert server.http.get("/tokenizer_info").status_code == 404
    options = ServerOptions(
        served_model_names=["base"],
        lora_modules=[LoRAModulePath("sql", adapter_dir)],
        frontend=FrontendOptions(enable_tokenizer_info_endpoint=True),
    )
    with RunningServer(FakeEngine(tokenizer), options) as running:
        info = running.http.get("/tokenizer_info")
        assert info.status_code == 200, info.text
        body = info.json()
        assert body["tokenizer_class"] == type(tokenizer).__name__
        assert body["chat_template"] == tokenizer.chat_template
        assert "vocab_file" not in body and "merges_file" not in body


def test_load_counts_requests_in_flight_with_its_flag(tokenizer, adapter_dir: str) -> None:
    options = ServerOptions(
        served_model_names=["base"],
        lora_modules=[LoRAModulePath("sql", adapter_dir)],
        frontend=FrontendOptions(enable_server_load_tracking=True),
    )
    with RunningServer(FakeEngine(tokenizer), options) as running:
        assert running.http.get("/load").json() == {"server_load": 0}
        hold_generation(running, num_free_tokens=1)
        client = openai.OpenAI(base_url=running.url + "/v1", api_key="x", max_retries=0)
        results: list[Any] = []

        def stream(model: str) -> None:
            chunks = client.completions.create(model=model, prompt="hi", max_tokens=4, stream=True)
            results.append([c.choices[0].text for c in chunks if c.choices])

        def whole() -> None:
            results.append(client.chat.completions.create(model="sql", messages=MESSAGES, max_tokens=4))

        threads = [
            threading.Thread(target=stream, args=("base",)),
            threading.Thread(target=stream, args=("sql",)),
        ]
        threads.append(threading.Thread(target=whole))
        for thread in threads:
            thread.start()
        wait_for(lambda: len(running.engine.running) == 3, what="three requests running")
        assert running.http.get("/load").json() == {"server_load": 3}
        release_generation(running)
        for thread in threads:
            thread.join(30)
        assert len(results) == 3
        wait_for(lambda: running.http.get("/load").json() == {"server_load": 0}, what="the load to drop")
        bad = running.http.post("/v1/completions", json={"model": "nope", "prompt": "x"})
        assert bad.status_code == 404 and running.http.get("/load").json() == {"server_load": 0}


def test_load_is_zero_without_its_flag(server: RunningServer) -> None:
    hold_generation(server, num_free_tokens=1)
    done = threading.Event()

    def run() -> None:
        server.http.post("/v1/completions", json={"model": "base", "prompt": "x", "max_tokens": 3})
        done.set()

    thread = threading.Thread(target=run)
    thread.start()
    try:
        wait_for(lambda: len(server.engine.running) == 1, what="the request to run")
        assert server.http.get("/load").json() == {"server_load": 0}
    finally:
        release_generation(server)
        thread.join(30)
    assert done.is_set()
