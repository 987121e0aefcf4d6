"""`POST /v1/load_lora_adapter` with `load_inplace` on the real engine, and adapter paths as vLLM
users write them (`~/...`) on the load route and in --lora-modules.

Oracle: the same adapter files loaded under names of their own on the same server.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest
from support.harness import RunningServer

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

PROMPT = list(range(10, 50))


@pytest.fixture(scope="module")
def home(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A home folder with two adapters of one shape: ~/adapters/step1 and ~/adapters/step2."""
    from loraserve.demo.random_model import save_peft_adapter

    root = tmp_path_factory.mktemp("home")
    for seed, name in enumerate(("step1", "step2")):
        save_peft_adapter(hf_model(tiny_model("llama")), str(root / "adapters" / name), 90 + seed,
                          tiny_model("llama"), r=8, lora_alpha=32, target_modules=["q_proj", "v_proj", "o_proj"])
    return root


@pytest.fixture()
def server(tiny_model: Any, home: Path, monkeypatch: pytest.MonkeyPatch):
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    monkeypatch.setenv("HOME", str(home))
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=tiny_model("llama"), dtype="float32", device="cpu", max_model_len=96, enable_lora=True,
                   max_loras=3, max_cpu_loras=6, max_lora_rank=8)
    )
    options = ServerOptions(
        served_model_names=["tiny"],
        lora_modules=[LoRAModulePath("policy", "~/adapters/step1")],
        allow_runtime_lora_updating=True,
    )
    with RunningServer(engine, options) as running:
        yield running


def completion(server: RunningServer, model: str, max_tokens: int = 8) -> str:
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    response = server.http.post("/v1/completions", json=body)
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def load(server: RunningServer, name: str, path: str, **extra: Any) -> httpx.Response:
    return server.http.post("/v1/load_lora_adapter", json={"lora_name": name, "lora_path": path, **extra})


def test_load_inplace_replaces_the_weights(server: RunningServer, home: Path) -> None:
    assert load(server, "ref1", str(home / "adapters" / "step1")).status_code == 200
    assert load(server, "ref2", "~/adapters/step2").status_code == 200  # ~ on the load route
    ref1, ref2 = completion(server, "ref1", 30), completion(server, "ref2", 30)
    assert ref1 != ref2 and completion(server, "policy", 30) == ref1  # ~ in --lora-modules
    refused = load(server, "policy", "~/adapters/step2")
    assert refused.status_code == 400 and refused.json()["error"]["type"] == "InvalidUserInput"
    assert "already been loaded" in refused.json()["error"]["message"]

    body = {"model": "policy", "prompt": PROMPT, "max_tokens": 30, "temperature": 0, "ignore_eos": True,
            "stream": True}
    text = ""
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=30) as stream:
        lines = stream.iter_lines()
        for line in lines:  # the request is running on the old weights once its first token is out
            if line.startswith("data: {"):
                text += json.loads(line[6:])["choices"][0]["text"]
                break
        reloaded = load(server, "policy", "~/adapters/step2", load_inplace=True)
        assert reloaded.status_code == 200, reloaded.text
        for line in lines:
            if line.startswith("data: {"):
                text += "".join(choice["text"] for choice in json.loads(line[6:])["choices"])
    assert text == ref1  # the running request finished on the weights it started with
    assert completion(server, "policy", 30) == ref2  # new requests: the new weights, no stale prefix KV
    cards = [card for card in server.http.get("/v1/models").json()["data"] if card["id"] == "policy"]
    assert [card["root"] for card in cards] == ["~/adapters/step2"]


def test_load_inplace_of_a_new_name_is_a_plain_load(server: RunningServer, home: Path) -> None:
    assert load(server, "fresh", "~/adapters/step2", load_inplace=True).status_code == 200
    assert load(server, "ref2", str(home / "adapters" / "step2")).status_code == 200
    assert completion(server, "fresh") == completion(server, "ref2")


def test_a_failed_inplace_load_keeps_the_old_weights(server: RunningServer, home: Path) -> None:
    before = completion(server, "policy")
    missing = load(server, "policy", str(home / "adapters" / "missing"), load_inplace=True)
    assert missing.status_code == 404 and "No adapter found" in missing.json()["error"]["message"]
    shutil.copytree(home / "adapters" / "step1", home / "adapters" / "broken", dirs_exist_ok=True)
    (home / "adapters" / "broken" / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 64}')
    too_big = load(server, "policy", "~/adapters/broken", load_inplace=True)
    assert too_big.status_code == 400 and too_big.json()["error"]["type"] == "InvalidUserInput"
    assert completion(server, "policy") == before
