"""The cluster simulator against the real thing: one trace, simulated and replayed on a real
`loraserve serve --replicas 2` (affinity routing), side by side.

    python -m benchmarks.cluster_validate

1. the grid's model (SmolLM-135M-shaped, random) and 32 of its rank-16 adapters (benchmarks/common.py);
2. their costs, measured here with one thread (what each replica gets: --replica-cpus 1);
3. a Poisson trace with Zipf adapter popularity, simulated with those costs;
4. the same trace replayed open-loop against the real server (a local Ray started here, the server
   joining it), streaming, with adapters resolved from the shared folder;
5. hit rate (requests that caused no read from the adapter store: 1 - engine loads / requests) and
   TTFT p50/p99, simulated vs real. Results: benchmarks/results/cluster_validate.json.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import subprocess
import sys
import time
from dataclasses import asdict
from typing import Any

from benchmarks.cluster_costs import measure
from benchmarks.cluster_sim import percentile
from benchmarks.cluster_sim_model import Cluster, SimConfig, make_trace
from benchmarks.common import build_adapters, build_model, save_results

NUM_ADAPTERS = 32
SERVER_FLAGS = ["--replicas", "2", "--replica-cpus", "1", "--enable-lora", "--max-loras", "8",
                "--max-cpu-loras", "12", "--max-lora-rank", "16", "--max-model-len", "128"]  # fmt: skip


def build_fixture() -> tuple[str, list[str]]:
    """The simulator grid's model (SmolLM-135M-shaped, random) and rank-16 adapters (built once)."""
    model = build_model()
    return model, build_adapters(model, NUM_ADAPTERS)


def simulate(config: SimConfig, trace: list[tuple[float, int]], costs: Any) -> dict[str, float]:
    cluster = Cluster(config, costs)
    cluster.run(trace)
    ttfts = [(r.first_token_at or r.arrival) - r.arrival for r in cluster.finished]
    return {"hit_rate": 1 - len(cluster.loads) / len(trace), "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99)}  # fmt: skip


async def replay(url: str, trace: list[tuple[float, int]], config: SimConfig) -> list[tuple[float, str]]:
    """Send each request at its arrival time; (TTFT, replica) of each, in trace order."""
    import httpx

    rng = random.Random(1)
    prompts = [[rng.randrange(10, 500) for _ in range(config.prompt_len)] for _ in trace]

    async def one(client: httpx.AsyncClient, start: float, index: int) -> tuple[float, str]:
        at, adapter = trace[index]
        await asyncio.sleep(max(0.0, start + at - time.perf_counter()))
        sent = time.perf_counter()
        body = {"model": f"a{adapter:03d}", "prompt": prompts[index], "max_tokens": config.gen_len,
                "temperature": 0, "ignore_eos": True, "stream": True}  # fmt: skip
        async with client.stream("POST", f"{url}/v1/completions", json=body) as response:
            assert response.status_code == 200, await response.aread()
            ttft = None
            async for line in response.aiter_lines():
                if ttft is None and line.startswith("data: {"):
                    ttft = time.perf_counter() - sent
            return ttft or float("nan"), response.headers["x-loraserve-replica"]

    async with httpx.AsyncClient(timeout=600, limits=httpx.Limits(max_connections=1000)) as client:
        start = time.perf_counter()
        return list(await asyncio.gather(*(one(client, start, i) for i in range(len(trace)))))


def run_real(model: str, store: str, trace: list[tuple[float, int]], config: SimConfig) -> dict[str, Any]:
    import httpx
    import ray
    from ray import serve

    from loraserve.entrypoints.ray.router import TARGET_PREFIX

    ray.init(address="local", num_cpus=2, include_dashboard=False, object_store_memory=128 << 20)
    port = 18000 + os.getpid() % 1000
    env = {**os.environ, "RAY_ADDRESS": ray.get_runtime_context().gcs_address, "LORASERVE_LOGGING_LEVEL": "WARNING",
           "LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "true", "LORASERVE_LORA_RESOLVER_CACHE_DIR": store}  # fmt: skip
    cmd = [sys.executable, "-m", "loraserve.entrypoints.cli", "serve", model, *SERVER_FLAGS,
           "--host", "127.0.0.1", "--port", str(port)]  # fmt: skip
    server = subprocess.Popen(cmd, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 300
        while True:
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert server.poll() is None and time.monotonic() < deadline, "the server did not start"
            time.sleep(1)
        results = asyncio.run(replay(url, trace, config))
        handle = serve.get_app_handle("loraserve")
        replicas = sorted({rid for _, rid in results})
        stats = [
            handle.options(multiplexed_model_id=TARGET_PREFIX + rid).stats.remote().result()
            for rid in replicas
        ]
    finally:
        server.terminate()
        server.wait(120)
        ray.shutdown()
    ttfts = [t for t, _ in results]
    loads = sum(s.get("lora_num_loads", 0) for s in stats)
    return {"hit_rate": 1 - loads / len(trace), "ttft_p50_s": percentile(ttfts, 0.5),
            "ttft_p99_s": percentile(ttfts, 0.99), "requests_per_replica": {
                rid: sum(1 for _, r in results if r == rid) for rid in replicas}}  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=240)
    parser.add_argument("--rate", type=float, default=None, help="requests/s (default: 50%% of capacity)")
    args = parser.parse_args()
    model, adapters = build_fixture()
    costs = measure(model, adapters, threads=1, max_loras=8)
    print(f"costs: {costs}")
    config = SimConfig(2, NUM_ADAPTERS, "affinity", 1.0, args.requests, prompt_len=32, gen_len=16, max_loras=8,
                       max_cpu_loras=12, warmup_fraction=0.0, seed=3)  # fmt: skip
    capacity = 1 / (config.gen_len * costs.step_s(8) / 8 + config.prompt_len * costs.prefill_per_token_s)
    rate = args.rate or 0.5 * 2 * capacity
    config = SimConfig(**{**asdict(config), "rate_per_s": rate})
    trace = make_trace(config, random.Random(config.seed))
    sim = {
        p: simulate(SimConfig(**{**asdict(config), "policy": p}), trace, costs)
        for p in ("random", "affinity")
    }
    real = run_real(model, os.path.dirname(adapters[0]), trace, config)
    print(f"{len(trace)} requests at {rate:.2f}/s over {NUM_ADAPTERS} adapters, 2 replicas")
    print(f"{'':<16}{'hit rate':>10}{'TTFT p50':>10}{'p99':>9}")
    for name, row in (
        ("sim random", sim["random"]),
        ("sim affinity", sim["affinity"]),
        ("real affinity", real),
    ):
        print(f"{name:<16}{row['hit_rate']:>10.1%}{row['ttft_p50_s']:>9.3f}s{row['ttft_p99_s']:>8.3f}s")
    save_results(
        "cluster_validate", {"costs": costs.to_json(), "config": asdict(config), "sim": sim, "real": real}
    )


if __name__ == "__main__":
    main()
