"""vLLM's metric names and labels on /metrics (fake engine, real server; and the replicas' ingress):
the queue-depth gauges autoscalers read, per engine, beside loraserve's own series."""

from __future__ import annotations

import asyncio
import threading
from typing import Any

from prometheus_client.parser import text_string_to_metric_families
from support.fake_engine import hold_generation, release_generation
from support.harness import RunningServer, wait_for

from loraserve.entrypoints.openai.metrics.metrics import ServerMetrics


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def _key(
    name: str, engine: str = "0", model: str = "base", **labels: str
) -> tuple[str, tuple[tuple[str, str], ...]]:
    return name, tuple(sorted({"model_name": model, "engine": engine, **labels}.items()))


def test_queue_depth_gauges_follow_the_engine(server: RunningServer) -> None:
    hold_generation(server, num_free_tokens=1)
    server.call(lambda: server.engine.waiting.update({"sql": 3}))
    threads = [
        threading.Thread(
            target=lambda m=model: server.http.post(
                "/v1/completions", json={"model": m, "prompt": "x", "max_tokens": 3}
            )
        )
        for model in ("base", "sql")
    ]
    for thread in threads:
        thread.start()
    try:
        wait_for(lambda: len(server.engine.running) == 2, what="two requests running")
        held = _samples(server.http.get("/metrics").text)
        assert held[_key("vllm:num_requests_running")] == 2
        assert held[_key("vllm:num_requests_waiting")] == 3
        assert held[("loraserve:num_requests_running", ())] == 2  # ours stay beside
    finally:
        release_generation(server)
        server.call(lambda: server.engine.waiting.clear())
        for thread in threads:
            thread.join(30)
    idle = _samples(server.http.get("/metrics").text)
    assert idle[_key("vllm:num_requests_running")] == 0 and idle[_key("vllm:num_requests_waiting")] == 0
    assert idle[_key("vllm:request_success_total", finished_reason="length")] >= 2


def test_each_replica_is_an_engine_behind_the_ingress() -> None:
    def replica(running: int, free: int) -> dict[str, Any]:
        return {"num_running": running, "num_waiting": 1, "kv_blocks_free": free, "kv_blocks_total": 100,
                "prefix_cache_query_tokens": 50, "prefix_cache_hit_tokens": 20, "num_preemptions": 0}  # fmt: skip

    async def replica_stats() -> dict[str, Any]:
        return {"r1": replica(2, 75), "r2": replica(5, 40), "r3": None}

    metrics = ServerMetrics(lambda: {"num_replicas": 3}, replica_stats, model_name="m")
    samples = _samples(asyncio.run(metrics.render_async()).decode())
    assert samples[_key("vllm:num_requests_running", "r1", "m")] == 2
    assert samples[_key("vllm:num_requests_running", "r2", "m")] == 5
    assert samples[_key("vllm:kv_cache_usage_perc", "r1", "m")] == 0.25
    assert samples[_key("vllm:kv_cache_usage_perc", "r2", "m")] == 0.6
    assert samples[_key("vllm:prefix_cache_hits_total", "r2", "m")] == 20
    assert _key("vllm:num_requests_running", "r3", "m") not in samples  # it did not answer
    assert _key("vllm:num_requests_running", "0", "m") not in samples  # the ingress has no engine of its own
