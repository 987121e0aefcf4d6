"""Scale-out simulator: how random, power-of-two-choices and adapter-affinity routing compare with R
replicas and A adapters (Zipf popularity, Poisson arrivals), on costs measured on this machine.

    python -m benchmarks.cluster_sim            # the grid R = 2..256 x A = 100..100,000
    python -m benchmarks.cluster_sim --quick    # a smaller grid
    python -m benchmarks.cluster_validate       # the model against the real 2-replica server

Costs come from benchmarks/results/cluster_costs.json (`python -m benchmarks.cluster_costs`); the
model is benchmarks/cluster_sim_model.py. Reports per configuration: hit rate (requests that caused no
read from the adapter store), cold loads/s, store seconds per second (the time the loads spent
reading), p50/p99 time to first token, generated tokens/s per replica. `--eviction lru,cost` runs each
configuration under both host-cache policies (with `--rank-mix` and `--remote-fraction`, adapters
differ in what a miss costs). Prints a table and writes benchmarks/results/cluster_sim.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from dataclasses import asdict, replace
from typing import Any

from benchmarks.cluster_costs import Costs
from benchmarks.cluster_sim_model import POLICIES, Cluster, SimConfig
from benchmarks.common import save_results

RESULTS = os.path.join(os.path.dirname(__file__), "results")
GRID_REPLICAS = (2, 16, 64, 256)
GRID_ADAPTERS = (100, 1_000, 10_000, 100_000)
REFERENCE_BATCH = 32  # the batch size whose throughput defines one replica's capacity


def load_costs(path: str | None = None) -> Costs:
    with open(path or os.path.join(RESULTS, "cluster_costs.json")) as f:
        return Costs.from_json(json.load(f))


def capacity_req_per_s(costs: Costs, config: SimConfig) -> float:
    """Requests per second one replica completes at the reference batch size (prefills included)."""
    step = costs.step_s(REFERENCE_BATCH)
    per_request = config.gen_len * step / REFERENCE_BATCH + config.prompt_len * costs.prefill_per_token_s
    return 1.0 / per_request


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


def summarize(cluster: Cluster) -> dict[str, float]:
    """Metrics over the measured window: from the end of the warm-up to the last arrival."""
    config = cluster.config
    arrivals = sorted(r.arrival for r in cluster.finished)
    start, end = arrivals[int(config.warmup_fraction * len(arrivals))], arrivals[-1]
    window = max(end - start, 1e-9)
    measured = [r for r in cluster.finished if start <= r.arrival <= end]
    ttfts = [(r.first_token_at or r.arrival) - r.arrival for r in measured]
    num_loads = sum(1 for t in cluster.loads if start <= t <= end)
    store_s = sum(s for t, s in cluster.load_seconds if start <= t <= end)
    tokens = sum(n for t, n in cluster.tokens if start <= t <= end)
    return {
        "hit_rate": 1.0 - num_loads / max(len(measured), 1),
        "cold_loads_per_s": num_loads / window,
        "store_s_per_s": store_s / window / config.num_replicas,
        "ttft_p50_s": statistics.median(ttfts),
        "ttft_p99_s": percentile(ttfts, 0.99),
        "tok_per_s_per_replica": tokens / window / config.num_replicas,
    }


def simulate(config: SimConfig, costs: Costs) -> dict[str, float]:
    cluster = Cluster(config, costs)
    cluster.run()
    return summarize(cluster)


def grid(args: argparse.Namespace, costs: Costs) -> list[dict[str, Any]]:
    rows = []
    replicas = (2, 16, 64) if args.quick else GRID_REPLICAS
    adapters = (100, 10_000) if args.quick else GRID_ADAPTERS
    replicas = tuple(int(r) for r in args.replicas.split(",")) if args.replicas else replicas
    adapters = tuple(int(a) for a in args.adapters.split(",")) if args.adapters else adapters
    for num_replicas in replicas:
        for num_adapters in adapters:
            base = SimConfig(num_replicas, num_adapters, "random", 1.0, 0, zipf_s=args.zipf_s,
                             spread_queue_depth=args.spread_queue_depth, num_loaders=args.loaders,
                             seed=args.seed, rank_mix=args.rank_mix, remote_fraction=args.remote_fraction,
                             remote_factor=args.remote_factor)  # fmt: skip
            rate = args.load * num_replicas * capacity_req_per_s(costs, base)
            num_requests = max(args.min_requests, args.requests_per_replica * num_replicas)
            for policy in args.policies.split(","):
                for eviction in args.eviction.split(","):
                    config = replace(base, policy=policy, rate_per_s=rate, num_requests=num_requests,
                                     eviction=eviction)  # fmt: skip
                    started = time.perf_counter()
                    metrics = simulate(config, costs)
                    rows.append({"replicas": num_replicas, "adapters": num_adapters, "policy": policy,
                                 "eviction": eviction, "rate_per_s": rate, "num_requests": num_requests,
                                 **metrics})  # fmt: skip
                    print_row(rows[-1], time.perf_counter() - started)
    return rows


def print_header() -> None:
    print(f"{'R':>4} {'A':>7} {'policy':<9} {'evict':<5} {'hit':>6} {'cold/s':>8} {'store s/s':>9} "
          f"{'TTFT p50':>9} {'p99':>8} {'tok/s/rep':>10}  (wall)")  # fmt: skip


def print_row(row: dict[str, Any], wall_s: float) -> None:
    print(f"{row['replicas']:>4} {row['adapters']:>7} {row['policy']:<9} {row['eviction']:<5} "
          f"{row['hit_rate']:>6.1%} {row['cold_loads_per_s']:>8.1f} {row['store_s_per_s']:>9.2f} "
          f"{row['ttft_p50_s']:>8.2f}s {row['ttft_p99_s']:>7.2f}s "
          f"{row['tok_per_s_per_replica']:>10.1f}  ({wall_s:.1f}s)", flush=True)  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a smaller grid (R up to 64, A 100 and 10k)")
    parser.add_argument("--load", type=float, default=0.6, help="offered load, a fraction of capacity")
    parser.add_argument("--zipf-s", type=float, default=1.0, help="Zipf exponent of adapter popularity")
    parser.add_argument("--spread-queue-depth", type=int, default=8)
    parser.add_argument("--requests-per-replica", type=int, default=400)
    parser.add_argument("--min-requests", type=int, default=6000)
    parser.add_argument("--costs", default=None, help="a cluster_costs.json (default: the measured one)")
    parser.add_argument(
        "--cold-load-s",
        type=float,
        default=None,
        help="override the measured cold load (e.g. 1.5 for a remote object store)",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--loaders", type=int, default=1, help="concurrent adapter loads per replica")
    parser.add_argument("--out", default="cluster_sim", help="results file name in benchmarks/results/")
    parser.add_argument("--policies", default=",".join(POLICIES), help="routing policies to run")
    parser.add_argument("--replicas", default="", help="replica counts (default: the grid's)")
    parser.add_argument("--adapters", default="", help="adapter counts (default: the grid's)")
    parser.add_argument("--eviction", default="lru", help="host-cache policies to run: lru, cost or lru,cost")
    parser.add_argument("--rank-mix", action="store_true", help="ranks 8/16/32/64: loads scale with rank")
    parser.add_argument("--remote-fraction", type=float, default=0.0, help="adapters on a slow store")
    parser.add_argument("--remote-factor", type=float, default=1.0, help="how much slower its loads are")
    args = parser.parse_args()
    costs = load_costs(args.costs)
    if args.cold_load_s is not None:
        costs = replace(costs, cold_load_s=args.cold_load_s, source=costs.source + ", cold load overridden")
    defaults = SimConfig(0, 0, "", 0.0, 0, num_loaders=args.loaders)
    print(f"costs ({costs.source}): step {costs.step_base_s * 1e3:.1f} ms + {costs.step_per_seq_s * 1e3:.1f} "
          f"ms/seq, prefill {costs.prefill_per_token_s * 1e3:.2f} ms/token, cold load "
          f"{costs.cold_load_s * 1e3:.0f} ms, slot upload {costs.slot_upload_s * 1e3:.1f} ms")  # fmt: skip
    print(f"per replica: {defaults.max_loras} slots, {defaults.max_cpu_loras} adapters in host memory, "
          f"batch <= {defaults.max_num_seqs}, {defaults.num_loaders} loader(s); prompt {defaults.prompt_len}, output {defaults.gen_len} tokens; "
          f"offered load {args.load:.0%} of capacity")  # fmt: skip
    print_header()
    rows = grid(args, costs)
    out = {"costs": costs.to_json(), "defaults": asdict(defaults), "args": vars(args), "rows": rows}
    save_results(args.out, out)


if __name__ == "__main__":
    main()
