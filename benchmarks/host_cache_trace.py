"""The LoRA host cache under the scheduler's access pattern: disk reads against an ideal LRU.

A closed loop keeps `in_flight` requests in an `LLMEngine` (a new one as each finishes), each on an
adapter drawn uniformly at random from 12, with `max_cpu_loras` 8 and few compute slots; the
engine's own counters give the disk reads and host hits. Beside them: an ideal LRU over the same
request sequence (it sees each request's adapter once, at its arrival), and the analytic bound of LRU
under uniform random access, max_cpu_loras / num_adapters = 8/12 (every adapter is equally likely
next, and LRU holds 8 of the 12). Hit rate = 1 - disk reads / requests, first loads included (the
simulated LRU counts them too). A tiny random Llama: the point is the counts, not the speed.
Usage: python -m benchmarks.host_cache_trace [--requests 1200] [--in-flight 8,32] [--max-loras 2]
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
from collections import OrderedDict
from dataclasses import asdict, dataclass
from typing import Any

from benchmarks.common import bench_root, save_results
from loraserve.demo.random_model import (
    TINY_SHAPE,
    build_tokenizer,
    llama_config,
    save_peft_adapter,
    save_random_model,
)
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.llm_engine import LLMEngine
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams

NUM_ADAPTERS = 12
HOST_ENTRIES = 8
TINY = TINY_SHAPE


@dataclass(frozen=True, slots=True)
class TraceCounts:
    requests: int
    disk_reads: int  # the engine's lora_num_loads: first loads and reloads after eviction
    host_hits: int  # requests that found their adapter in host memory on arrival
    needed_evictions: int  # adapters that left host memory while queued requests still used them
    lru_reads: int  # an ideal LRU of the same size over the same request sequence

    @property
    def hit_rate(self) -> float:
        return 1.0 - self.disk_reads / self.requests

    @property
    def lru_hit_rate(self) -> float:
        return 1.0 - self.lru_reads / self.requests


def uniform_trace(num_requests: int, num_adapters: int = NUM_ADAPTERS, seed: int = 0) -> list[int]:
    """Adapter indexes drawn uniformly at random."""
    rng = random.Random(seed)
    return [rng.randrange(num_adapters) for _ in range(num_requests)]


def lru_reads(trace: list[int], capacity: int) -> int:
    """Disk reads of an ideal LRU cache of `capacity` adapters that sees `trace` in order."""
    cache: OrderedDict[int, None] = OrderedDict()
    reads = 0
    for adapter in trace:
        if adapter in cache:
            cache.move_to_end(adapter)
            continue
        reads += 1
        cache[adapter] = None
        if len(cache) > capacity:
            cache.popitem(last=False)
    return reads


def run_trace(
    engine: LLMEngine, adapters: list[LoRARequest], trace: list[int], in_flight: int, max_tokens: int = 2
) -> TraceCounts:
    """Run `trace` through `engine` (its LoRA counters fresh) with `in_flight` requests at a time;
    after every add and step, count the adapters that left host memory while still in demand."""
    assert engine.lora is not None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0.0)
    names = {request.lora_name: request.lora_id for request in adapters}
    resident = set[int]()
    needed_evictions = 0

    def watch() -> None:
        nonlocal resident, needed_evictions
        assert engine.lora is not None
        now = {names[name] for name in engine.lora.resident_adapters()["host"]}
        queued = {seq.lora_id for seq in [*engine.scheduler.waiting, *engine.scheduler.running]}
        needed_evictions += len((resident - now) & queued)
        resident = now

    issued = 0

    def issue() -> None:
        nonlocal issued
        engine.add_request(f"trace-{issued}", [5, 6, 7, 8, issued % 97 + 9], params, adapters[trace[issued]])
        issued += 1
        watch()

    for _ in range(min(in_flight, len(trace))):
        issue()
    while engine.has_unfinished_requests():
        finished = sum(output.finished for output in engine.step())
        watch()
        for _ in range(min(finished, len(trace) - issued)):
            issue()
    stats = engine.lora.stats()
    loads, hits = stats["lora_num_loads"], stats["lora_num_host_hits"]
    assert isinstance(loads, int) and isinstance(hits, int)
    return TraceCounts(
        len(trace), loads, hits, needed_evictions, lru_reads(trace, engine.lora.lora_config.cpu_capacity)
    )


def build_assets(root: str | None = None) -> tuple[str, list[str]]:
    """The tiny random Llama and 12 rank-8 PEFT adapters (built once, cached)."""
    root = root or os.path.join(bench_root(), "host-cache-trace")
    model = os.path.join(root, "model")
    adapters = [os.path.join(root, f"a{i:02d}") for i in range(NUM_ADAPTERS)]
    if not os.path.exists(os.path.join(adapters[-1], "adapter_config.json")):
        shutil.rmtree(root, ignore_errors=True)
        build_tokenizer(model)
        base = save_random_model(model, llama_config(512, **TINY), seed=0)
        for i, path in enumerate(adapters):
            save_peft_adapter(
                base,
                path,
                seed=100 + i,
                base_name=model,
                r=8,
                lora_alpha=16,
                target_modules=["q_proj", "v_proj"],
            )
    return model, adapters


def trace_engine(model: str, max_loras: int) -> LLMEngine:
    return LLMEngine.from_engine_args(
        EngineArgs(
            model=model,
            dtype="float32",
            enable_lora=True,
            max_loras=max_loras,
            max_cpu_loras=HOST_ENTRIES,
            max_lora_rank=8,
            kv_cache_memory_bytes=64 << 20,
        )
    )


def adapter_requests(paths: list[str]) -> list[LoRARequest]:
    return [LoRARequest(f"trace-a{i:02d}", i + 1, path) for i, path in enumerate(paths)]


def run_grid(num_requests: int, in_flight: list[int], max_loras: list[int]) -> list[dict[str, Any]]:
    model, paths = build_assets()
    trace = uniform_trace(num_requests)
    print_header()
    rows = []
    for loras in max_loras:
        for flight in in_flight:
            counts = run_trace(trace_engine(model, loras), adapter_requests(paths), trace, flight)
            rows.append(
                {
                    "in_flight": flight,
                    "max_loras": loras,
                    **asdict(counts),
                    "hit_rate": counts.hit_rate,
                    "lru_hit_rate": counts.lru_hit_rate,
                }
            )
            print_row(rows[-1])
    return rows


def print_header() -> None:
    print(
        f"{NUM_ADAPTERS} adapters drawn uniformly at random, max_cpu_loras {HOST_ENTRIES}; "
        f"LRU bound under uniform random access: {HOST_ENTRIES}/{NUM_ADAPTERS} = {HOST_ENTRIES / NUM_ADAPTERS:.3f}"
    )
    print(
        f"{'in flight':>9}{'max_loras':>10}{'requests':>9}{'disk reads':>11}{'host hits':>10}"
        f"{'hit rate':>9}{'LRU sim':>9}{'LRU reads':>10}{'evicted needed':>15}"
    )


def print_row(row: dict[str, Any]) -> None:
    print(
        f"{row['in_flight']:>9}{row['max_loras']:>10}{row['requests']:>9}{row['disk_reads']:>11}"
        f"{row['host_hits']:>10}{row['hit_rate']:>9.3f}{row['lru_hit_rate']:>9.3f}{row['lru_reads']:>10}"
        f"{row['needed_evictions']:>15}",
        flush=True,
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1200)
    parser.add_argument("--in-flight", default="8,32", help="requests kept in the engine at once")
    parser.add_argument("--max-loras", default="2", help="compute slots")
    args = parser.parse_args()
    rows = run_grid(
        args.requests,
        [int(x) for x in args.in_flight.split(",")],
        [int(x) for x in args.max_loras.split(",")],
    )
    save_results(
        "host_cache_trace",
        {
            "num_adapters": NUM_ADAPTERS,
            "max_cpu_loras": HOST_ENTRIES,
            "lru_bound": HOST_ENTRIES / NUM_ADAPTERS,
            "rows": rows,
        },
    )


if __name__ == "__main__":
    main()
