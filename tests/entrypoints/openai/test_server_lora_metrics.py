"""LoRA metrics for routers through /metrics: which adapters are resident per level (real engine, one
compute slot and two host entries, so every move between levels is forced), loads counted, and vLLM's
lora_requests_info with its labels, under both the loraserve: and vllm: names."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fake_engine import FakeEngine, hold_generation, release_generation, write_adapter
from support.harness import RunningServer, wait_for

from loraserve.entrypoints.openai.server.api_server import ServerOptions
from loraserve.entrypoints.openai.serving.serving_models import LoRAModulePath

PREFIXES = ("loraserve:", "vllm:")


def samples(server: RunningServer, name: str) -> list[tuple[dict[str, str], float]]:
    """Every sample of metric family `name` on /metrics (both prefixes must agree)."""
    found: dict[str, list[tuple[dict[str, str], float]]] = {prefix: [] for prefix in PREFIXES}
    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        for prefix in PREFIXES:
            if family.name == prefix + name:
                found[prefix] += [(dict(s.labels), s.value) for s in family.samples if not s.name.endswith("_created")]
    assert found["loraserve:"] == found["vllm:"], name
    return found["loraserve:"]


def residency(server: RunningServer) -> dict[str, set[str]]:
    levels: dict[str, set[str]] = {"slot": set(), "host": set()}
    for labels, value in samples(server, "lora_adapter_loaded"):
        assert value == 1.0
        levels[labels["level"]].add(labels["lora_name"])
    return levels


def loads(server: RunningServer) -> dict[str, float]:
    return {labels["outcome"]: value for labels, value in samples(server, "lora_loads")}


def requests_info(server: RunningServer) -> tuple[dict[str, str], float]:
    (only,) = samples(server, "lora_requests_info")
    return only


@pytest.fixture(scope="module")
def engine_and_adapters(tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory):
    from loraserve.demo.random_model import save_peft_adapter
    from loraserve.engine.arg_utils import EngineArgs
    from loraserve.engine.async_engine import AsyncLLMEngine

    model_dir = tiny_model("llama")
    root = tmp_path_factory.mktemp("metrics-adapters")
    paths = {}
    for seed, name in enumerate(("a", "b", "c")):
        paths[name] = str(root / name)
        save_peft_adapter(hf_model(model_dir), paths[name], 20 + seed, model_dir, r=4, target_modules=["q_proj"])
    engine = AsyncLLMEngine.from_engine_args(
        EngineArgs(model=model_dir, dtype="float32", device="cpu", max_model_len=64, enable_lora=True,
                   max_loras=1, max_cpu_loras=2, max_lora_rank=8, kv_cache_memory_bytes=8 << 20)
    )
    return engine, paths


def test_residency_follows_slots_and_host_cache(engine_and_adapters) -> None:
    engine, paths = engine_and_adapters
    options = ServerOptions(served_model_names=["tiny"], allow_runtime_lora_updating=True)
    with RunningServer(engine, options) as server:
        assert residency(server) == {"slot": set(), "host": set()} and loads(server) == {"success": 0, "failure": 0}
        labels, stamp = requests_info(server)
        assert labels == {"max_lora": "1", "waiting_lora_adapters": "", "running_lora_adapters": ""}
        assert stamp > 1.6e9  # a Unix time, as vLLM sets it

        def load_and_run(name: str) -> None:
            body = {"lora_name": name, "lora_path": paths[name]}
            if name not in {card["id"] for card in server.http.get("/v1/models").json()["data"]}:
                assert server.http.post("/v1/load_lora_adapter", json=body).status_code == 200
            response = server.http.post("/v1/completions", json={"model": name, "prompt": [5, 6, 7], "max_tokens": 2})
            assert response.status_code == 200, response.text

        load_and_run("a")
        assert residency(server) == {"slot": {"a"}, "host": {"a"}}
        load_and_run("b")  # one slot: b takes it; a stays in host memory
        assert residency(server) == {"slot": {"b"}, "host": {"a", "b"}}
        load_and_run("c")  # two host entries: a, the least recently used, leaves host memory
        assert residency(server) == {"slot": {"c"}, "host": {"b", "c"}}
        assert loads(server) == {"success": 3, "failure": 0}
        load_and_run("a")  # read again from disk: a load, and b leaves host memory
        assert residency(server) == {"slot": {"a"}, "host": {"a", "c"}}
        assert loads(server) == {"success": 4, "failure": 0}
        bad = {"lora_name": "bad", "lora_path": paths["a"] + "-missing"}
        assert server.http.post("/v1/load_lora_adapter", json=bad).status_code == 404
        assert loads(server)["success"] == 4
        events = {
            (s.labels["event"], s.labels["policy"]): s.value
            for family in text_string_to_metric_families(server.http.get("/metrics").text)
            if family.name == "loraserve:lora_cache_events"
            for s in family.samples
            if s.name.endswith("_total")
        }
        assert events == {
            ("host_eviction", "cost"): 2.0,
            ("prefetch", "cost"): 0.0,
            ("prefetch_failure", "cost"): 0.0,
        }


def test_requests_info_names_running_and_waiting_adapters(tokenizer, tmp_path) -> None:
    modules = [LoRAModulePath(name, write_adapter(str(tmp_path / name))) for name in ("sql", "fr")]
    engine = FakeEngine(tokenizer)
    with RunningServer(engine, ServerOptions(served_model_names=["base"], lora_modules=modules)) as server:
        engine.waiting = {"fr": 2, "": 1}
        hold_generation(server)
        body = {"model": "sql", "prompt": "x", "max_tokens": 2}
        worker = threading.Thread(target=lambda: server.http.post("/v1/completions", json=body))
        worker.start()
        try:
            wait_for(lambda: len(engine.running) == 1, what="the request to run")
            labels, _ = requests_info(server)
            assert labels == {"max_lora": "2", "waiting_lora_adapters": "fr", "running_lora_adapters": "sql"}
            assert residency(server) == {"slot": {"sql"}, "host": {"fr", "sql"}}
        finally:
            release_generation(server)
        worker.join(30)
        engine.waiting = {}
        labels, _ = requests_info(server)
        assert labels["running_lora_adapters"] == "" and labels["waiting_lora_adapters"] == ""


def test_no_lora_metrics_without_lora(tokenizer) -> None:
    with RunningServer(FakeEngine(tokenizer, lora_enabled=False), ServerOptions(served_model_names=["base"])) as server:
        text = server.http.get("/metrics").text
    for prefix in PREFIXES:
        assert prefix + "lora_requests_info" not in text and prefix + "lora_adapter_loaded" not in text
