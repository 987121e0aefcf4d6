"""Keys with scopes (--api-key-file) on a live server, three keys: two customers and an admin (the fake
engine: adapters by name, generation held on demand). Each customer lists and uses only its adapters;
another customer's adapter is a 404 with exactly the text of a name that does not exist, however it
is named (model, a mix, a weighted model, a version, llama.cpp's `lora` ids, /v1/models/{id},
/tokenize, /invocations, unload by name or id); loads and unloads stay under the key's prefix and
folders; per-key limits hold while another key floods; metrics carry labels, never keys; a reload
(what SIGHUP runs) swaps the keys, and a bad file keeps the old ones. (SIGHUP itself:
test_hostile_process.py, on a real process.)
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from support.fake_engine import FakeEngine, hold_generation, release_generation, write_adapter
from support.harness import RunningServer, wait_for
from support.tool_calls import TEMPLATE

from loraserve.config import SchedulerConfig
from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.server.frontend_options import FrontendOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

ACME, BRAVO, ADMIN = "sk-acme-0123456789", "sk-bravo-9876543210", "sk-admin-5555555555"


def _key_file(path: Path, root: Path, acme_key: str = ACME, bravo: bool = True) -> None:
    keys: list[dict[str, Any]] = [
        {
            "key": acme_key,
            "label": "acme",
            "adapters": ["acme-*", "shared"],
            "base_model": True,
            "load": {"prefix": "acme-", "paths": [str(root / "acme")]},
            "limits": {"max_requests_in_flight": 2},
        },
        {"key": ADMIN, "label": "admin", "admin": True},
    ]
    if bravo:
        keys.insert(
            1,
            {
                "key": BRAVO,
                "label": "bravo",
                "adapters": ["bravo-*"],
                "limits": {"max_requests_in_flight": 3},
            },
        )
    path.write_text(yaml.safe_dump({"keys": keys}))


@pytest.fixture(scope="module")
def tenancy(tokenizer: Any, tmp_path_factory: pytest.TempPathFactory):
    root = tmp_path_factory.mktemp("tenancy")
    folders = {
        name: write_adapter(str(root / name.split("-")[0] / name))
        for name in ("acme-sql", "bravo-sql", "bravo-chat")
    }
    folders["shared"] = write_adapter(str(root / "shared"))
    key_file = root / "keys.yaml"
    _key_file(key_file, root)
    engine = FakeEngine(tokenizer, scheduler_config=SchedulerConfig(queue_wait_timeout_s=0))
    options = ServerOptions(
        served_model_names=["base"],
        api_key_file=str(key_file),
        lora_modules=[LoRAModulePath(name, path) for name, path in folders.items()],
        allow_runtime_lora_updating=True,
        frontend=FrontendOptions(chat_template=TEMPLATE),  # the Responses API renders chats
    )
    with RunningServer(engine, options) as server:
        yield server, root, key_file


def _as(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _complete(server: RunningServer, key: str, **body: Any) -> httpx.Response:
    return server.http.post(
        "/v1/completions", json={"prompt": [5, 6], "max_tokens": 2, **body}, headers=_as(key)
    )


def test_each_key_lists_only_its_adapters(tenancy: Any) -> None:
    server, _, _ = tenancy
    listed = {
        key: [m["id"] for m in server.http.get("/v1/models", headers=_as(key)).json()["data"]]
        for key in (ACME, BRAVO, ADMIN)
    }
    assert listed[ACME] == ["base", "acme-sql", "shared"]
    assert listed[BRAVO] == ["bravo-sql", "bravo-chat"]  # no base model for this key
    assert listed[ADMIN] == ["base", "acme-sql", "bravo-sql", "bravo-chat", "shared"]
    assert [a["name"] for a in server.http.get("/lora-adapters", headers=_as(ACME)).json()] == [
        "acme-sql",
        "shared",
    ]


def test_another_keys_adapter_is_missing_however_it_is_named(tenancy: Any) -> None:
    server, _, _ = tenancy
    assert _complete(server, ACME, model="acme-sql").status_code == 200
    digest = server.http.get("/v1/models", headers=_as(ADMIN)).json()["data"][2]["digest"]
    nobody = _complete(server, ACME, model="bravo-nope").json()["error"]  # a name that does not exist
    for body in (
        {"model": "bravo-sql"},
        {"model": f"bravo-sql@{digest[:12]}"},
        {"model": "bravo-sql=0.5"},
        {
            "model": "base",
            "adapters": [{"name": "acme-sql", "weight": 0.5}, {"name": "bravo-sql", "weight": 0.5}],
        },
    ):
        error = _complete(server, ACME, **body).json()["error"]
        assert error == {**nobody, "message": nobody["message"].replace("bravo-nope", "bravo-sql")}, body
    assert _complete(server, BRAVO, model="base").status_code == 404  # no base model for bravo
    # llama.cpp's `lora` ids index the key's own list: acme has two adapters, so id 2 does not exist.
    assert _complete(server, ACME, model="base", lora=[{"id": 1, "scale": 1.0}]).status_code == 200
    lora = _complete(server, ACME, model="base", lora=[{"id": 2, "scale": 1.0}]).json()["error"]
    assert "this server lists 2" in lora["message"]
    assert server.http.get("/v1/models/bravo-sql", headers=_as(ACME)).status_code == 404
    tokenize = server.http.post("/tokenize", json={"model": "bravo-sql", "prompt": "x"}, headers=_as(ACME))
    invocations = server.http.post(
        "/invocations", json={"model": "bravo-sql", "prompt": "x"}, headers=_as(ACME)
    )
    assert tokenize.status_code == invocations.status_code == 404
    assert tokenize.json()["error"]["message"] == nobody["message"].replace("bravo-nope", "bravo-sql")


def test_loads_and_unloads_stay_under_the_keys_prefix_and_folders(tenancy: Any) -> None:
    server, root, _ = tenancy
    new = write_adapter(str(root / "acme" / "acme-new"))
    elsewhere = write_adapter(str(root / "elsewhere" / "acme-x"))

    def load(key: str, name: str, path: str) -> httpx.Response:
        return server.http.post(
            "/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path}, headers=_as(key)
        )

    def unload(key: str, **body: Any) -> httpx.Response:
        return server.http.post("/v1/unload_lora_adapter", json=body, headers=_as(key))

    assert load(ACME, "acme-new", new).status_code == 200
    assert load(ACME, "bravo-new", new).status_code == 403
    assert load(ACME, "acme-x", elsewhere).status_code == 403
    assert load(BRAVO, "bravo-new", new).status_code == 403  # bravo may not load at all
    missing = unload(ACME, lora_name="acme-nope").json()["error"]
    hidden = unload(ACME, lora_name="bravo-sql").json()["error"]
    assert hidden == {**missing, "message": missing["message"].replace("acme-nope", "bravo-sql")}
    bravo_id = server.app.state.models.lora_requests["bravo-sql"].lora_id
    assert unload(ACME, lora_int_id=bravo_id).status_code == 404
    assert unload(ACME, lora_name="shared").status_code == 403  # acme may use it, not unload it
    assert unload(ACME, lora_name="acme-new").status_code == 200
    assert "bravo-sql" in server.app.state.models.lora_requests


def test_per_key_limits_hold_while_another_key_floods(tenancy: Any) -> None:
    server, _, _ = tenancy
    hold_generation(server)
    results: dict[str, list[int]] = {"acme": [], "bravo": []}

    def send(who: str, key: str) -> None:
        results[who].append(
            _complete(server, key, model="acme-sql" if who == "acme" else "bravo-sql").status_code
        )

    threads = [threading.Thread(target=send, args=("bravo", BRAVO)) for _ in range(8)]
    threads += [threading.Thread(target=send, args=("acme", ACME)) for _ in range(2)]
    try:
        for thread in threads:
            thread.start()
        wait_for(lambda: len(results["bravo"]) == 5, 30, "bravo's requests beyond its limit refused")
        wait_for(lambda: len(server.engine.running) == 5, 30, "bravo's 3 and acme's 2 admitted")
        third = _complete(server, ACME, model="acme-sql")  # acme's limit is 2
        assert third.status_code == 503 and "requests in flight" in third.json()["error"]["message"]
    finally:
        release_generation(server)
        for thread in threads:
            thread.join(30)
    assert sorted(results["bravo"]) == [200] * 3 + [503] * 5 and results["acme"] == [200, 200]


def test_metrics_carry_labels_never_keys(tenancy: Any) -> None:
    server, _, _ = tenancy
    text = server.http.get("/metrics", headers=_as(ADMIN)).text
    assert 'loraserve:api_key_requests_total{api_key="acme"}' in text
    assert not any(key in text for key in (ACME, BRAVO, ADMIN))


def test_responses_stay_with_the_key_that_made_them(tenancy: Any) -> None:
    server, _, _ = tenancy
    body = {"model": "acme-sql", "input": "hi", "max_output_tokens": 2}
    made = server.http.post("/v1/responses", json=body, headers=_as(ACME))
    assert made.status_code == 200, made.text
    rid = made.json()["id"]
    hidden = server.http.post("/v1/responses", json={**body, "model": "bravo-sql"}, headers=_as(ACME))
    assert hidden.status_code == 404
    never = server.http.get("/v1/responses/resp_nope", headers=_as(BRAVO)).json()["error"]
    other = server.http.get(f"/v1/responses/{rid}", headers=_as(BRAVO))
    assert other.status_code == 404 and other.json()["error"]["message"] == never["message"].replace(
        "resp_nope", rid
    )
    chained = {"model": "bravo-sql", "input": "x", "previous_response_id": rid}
    assert server.http.post("/v1/responses", json=chained, headers=_as(BRAVO)).status_code == 404
    assert server.http.delete(f"/v1/responses/{rid}", headers=_as(BRAVO)).status_code == 404
    assert server.http.get(f"/v1/responses/{rid}", headers=_as(ACME)).status_code == 200
    assert server.http.get(f"/v1/responses/{rid}", headers=_as(ADMIN)).status_code == 200


def test_a_reload_swaps_the_keys_and_a_bad_file_keeps_them(tenancy: Any) -> None:
    server, root, key_file = tenancy
    store = server.app.state.key_store
    rotated = "sk-acme-rotated-000"
    _key_file(key_file, root, acme_key=rotated, bravo=False)
    assert server.call(store.reload)
    assert server.http.get("/v1/models", headers=_as(ACME)).status_code == 401
    assert server.http.get("/v1/models", headers=_as(BRAVO)).status_code == 401
    assert [m["id"] for m in server.http.get("/v1/models", headers=_as(rotated)).json()["data"]] == [
        "base",
        "acme-sql",
        "shared",
    ]
    key_file.write_text("keys: [{key: x, label: 'no spaces allowed'}]")
    assert not server.call(store.reload)
    assert server.http.get("/v1/models", headers=_as(rotated)).status_code == 200
