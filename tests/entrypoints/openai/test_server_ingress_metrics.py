"""/metrics of a `--replicas` ingress: every replica's engine stats, each sample labelled `replica`, through
the same families a single server exports; a replica that gives no stats is left out and counted, and
the ingress waits a bounded time for each. (The 2-replica Ray cluster test is test_server_replicas.py's.)"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from importlib.util import find_spec
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from support.fake_engine import FakeEngine
from support.harness import RunningServer

from loraserve.entrypoints.openai.server.api_server import ServerOptions

PREFIXES = ("loraserve:", "vllm:")
HAS_RAY = find_spec("ray") is not None and find_spec("ray.serve") is not None


def replica_engine_stats(slot: list[str], host: list[str], running: dict[str, int], loads: int) -> dict[str, Any]:
    """One engine's `stats()` as the real engine shapes it (see LLMEngine.stats)."""
    return {
        "num_running": sum(running.values()),
        "num_waiting": 0,
        "running_by_adapter": running,
        "waiting_by_adapter": {},
        "num_step_failures": 0,
        "lora_num_loads": loads,
        "lora_num_load_failures": 0,
        "lora_load_seconds": [0.25] * loads,  # drained: new observations only
        "max_lora": 2,
        "lora_adapters_loaded": {"slot": slot, "host": host},
    }


@dataclass
class FakeIngress(FakeEngine):
    """The HTTP layer's view of a `ReplicaClient`: no engine of its own, replicas' stats on request."""

    replicas: dict[str, dict[str, Any] | None] = field(default_factory=dict)  # None: does not answer
    num_scrapes: int = 0

    def stats(self) -> dict[str, Any]:
        return {"num_replicas": len(self.replicas)}

    async def replica_stats(self) -> dict[str, dict[str, Any] | None]:
        self.num_scrapes += 1
        answers = {rid: dict(stats) if stats is not None else None for rid, stats in self.replicas.items()}
        for stats in self.replicas.values():  # lists are drained, like the engine's
            if stats is not None:
                stats["lora_load_seconds"] = []
        return answers


def scrape(server: RunningServer) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Metric family name -> its samples (sample name kept in the labels as `__name__`)."""
    families: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(server.http.get("/metrics").text):
        families.setdefault(family.name, []).extend(
            ({**s.labels, "__name__": s.name}, s.value) for s in family.samples if not s.name.endswith("_created")
        )
    return families


def by_replica(samples: list[tuple[dict[str, str], float]], **match: str) -> dict[str, float]:
    return {
        labels["replica"]: value
        for labels, value in samples
        if all(labels.get(k) == v for k, v in match.items())
    }


def test_ingress_exports_each_replica_labelled(tokenizer) -> None:
    ingress = FakeIngress(tokenizer)
    ingress.replicas = {
        "r1": replica_engine_stats(["sql"], ["fr", "sql"], {"sql": 3}, loads=2),
        "r2": replica_engine_stats(["fr"], ["fr"], {"fr": 1, "": 2}, loads=1),
        "r3": None,
    }
    with RunningServer(ingress, ServerOptions(served_model_names=["base"])) as server:
        metrics = scrape(server)
        for prefix in PREFIXES:
            loaded = metrics[prefix + "lora_adapter_loaded"]
            slots = {(labels["replica"], labels["lora_name"]) for labels, _ in loaded if labels["level"] == "slot"}
            assert slots == {("r1", "sql"), ("r2", "fr")}
            hosts = {(labels["replica"], labels["lora_name"]) for labels, _ in loaded if labels["level"] == "host"}
            assert hosts == {("r1", "fr"), ("r1", "sql"), ("r2", "fr")}
            assert by_replica(metrics[prefix + "lora_loads"], outcome="success") == {"r1": 2.0, "r2": 1.0}
            info = {labels["replica"]: labels for labels, _ in metrics[prefix + "lora_requests_info"]}
            assert set(info) == {"r1", "r2"}
            assert info["r2"]["running_lora_adapters"] == "fr" and info["r2"]["max_lora"] == "2"
        assert by_replica(metrics["loraserve:num_requests_running"]) == {"r1": 3.0, "r2": 3.0}
        running = {(labels["replica"], labels["lora_name"]): value
                   for labels, value in metrics["loraserve:num_requests_running_by_lora"]}  # fmt: skip
        assert running == {("r1", "sql"): 3.0, ("r2", ""): 2.0, ("r2", "fr"): 1.0}
        assert by_replica(metrics["loraserve:lora_load_seconds"], __name__="loraserve:lora_load_seconds_count") == {
            "r1": 2.0, "r2": 1.0}  # fmt: skip
        assert metrics["loraserve:num_replicas"] == [({"__name__": "loraserve:num_replicas"}, 3.0)]
        assert by_replica(metrics["loraserve:replica_scrape_failures"]) == {"r3": 1.0}
        ingress.replicas["r3"] = replica_engine_stats([], [], {}, loads=0)  # it answers again
        ingress.replicas["r1"] = None  # and r1 stops answering
        again = scrape(server)
        del ingress.replicas["r1"]  # then Ray replaces it: its series go
        replaced = scrape(server)
    assert by_replica(again["loraserve:replica_scrape_failures"]) == {"r1": 1.0, "r3": 1.0}
    assert set(by_replica(again["loraserve:lora_requests_info"])) == {"r2", "r3"}
    count = {"__name__": "loraserve:lora_load_seconds_count"}
    assert by_replica(again["loraserve:lora_load_seconds"], **count) == {"r1": 2.0, "r2": 1.0, "r3": 0.0}
    assert by_replica(replaced["loraserve:replica_scrape_failures"]) == {"r3": 1.0}
    assert by_replica(replaced["loraserve:lora_load_seconds"], **count) == {"r2": 1.0, "r3": 0.0}
    assert ingress.num_scrapes == 3


def test_single_server_metrics_have_no_replica_label(tokenizer) -> None:
    with RunningServer(FakeEngine(tokenizer), ServerOptions(served_model_names=["base"])) as server:
        text = server.http.get("/metrics").text
    assert "replica" not in text
    assert 'loraserve:lora_requests_info{max_lora="2",' in text


@dataclass
class FakeResponse:
    """A Ray DeploymentResponse: awaitable, cancellable; `answer` None never arrives."""

    answer: dict[str, Any] | BaseException | None
    cancelled: bool = False

    def __await__(self) -> Any:
        return self._wait().__await__()

    async def _wait(self) -> dict[str, Any]:
        if self.answer is None:
            await asyncio.Event().wait()
        if isinstance(self.answer, BaseException):
            raise self.answer
        assert self.answer is not None
        return self.answer

    def cancel(self) -> None:
        self.cancelled = True


class FakeHandle:
    """The deployment handle as `ReplicaClient` uses it for stats: `options(model id).stats.remote()`."""

    def __init__(self, answers: dict[str, Any]) -> None:
        self.answers = answers
        self.responses: dict[str, FakeResponse] = {}

    def options(self, multiplexed_model_id: str) -> Any:
        handle = self

        class Method:
            def remote(self) -> FakeResponse:
                from loraserve.entrypoints.ray.router import TARGET_PREFIX

                replica_id = multiplexed_model_id.removeprefix(TARGET_PREFIX)
                response = handle.responses[replica_id] = FakeResponse(handle.answers[replica_id])
                return response

        return type("Target", (), {"stats": Method()})()


@pytest.mark.skipif(not HAS_RAY, reason="needs the ray extra (ray[serve])")
def test_replica_client_waits_a_bounded_time_per_replica(monkeypatch: pytest.MonkeyPatch) -> None:
    from ray.exceptions import RayActorError

    from loraserve.entrypoints.ray import client as client_module
    from loraserve.entrypoints.ray.deployment import ReplicaInfo

    monkeypatch.setenv("LORASERVE_REPLICA_STATS_TIMEOUT", "0.2")
    handle = FakeHandle({"fast": {"num_running": 1}, "stuck": None, "dead": RayActorError()})
    monkeypatch.setattr(client_module, "known_replica_ids", lambda: set(handle.answers))
    client = client_module.ReplicaClient(handle, ReplicaInfo(None, None, None, None))
    assert client.stats_timeout_s == 0.2
    stats = asyncio.run(client.replica_stats())
    assert stats == {"dead": None, "fast": {"num_running": 1}, "stuck": None}
    assert handle.responses["stuck"].cancelled  # not left running on the replica
    monkeypatch.setenv("LORASERVE_REPLICA_STATS_TIMEOUT", "soon")
    with pytest.raises(ValueError, match="LORASERVE_REPLICA_STATS_TIMEOUT"):
        client_module.ReplicaClient(handle, ReplicaInfo(None, None, None, None))
