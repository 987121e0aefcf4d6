"""Cost-aware eviction and prefetch against LRU: the server trace's Zipf over 1000 adapters, ranks 8-64,
half of them on a slow store, through the async engine the server runs (in this process).

Adapter i has rank 8, 16, 32 or 64 and lives on the local disk or on a stand-in object store: a
folder whose every read first waits `S3_LATENCY_S` + bytes / `S3_BANDWIDTH` (a real delay in the read,
on whichever thread reads: a request's arrival, the prefetch thread, or the step loop reloading an
evicted adapter). The engine files those folders under source "s3" (LORASERVE_LORA_RESOLVER_S3_CACHE_DIR
points there), whose reload seconds it then measures. Each request picks its adapter from
`server_trace.zipf_trace`; `concurrency` clients each send the next request when theirs ends (closed
loop), streamed through `AsyncLLMEngine.generate` as the server does. Each configuration runs the
same trace on a fresh engine: "lru" (LRU, no prefetch: the behaviour before), "lru+prefetch",
"cost+prefetch" (the default). Reported: generated tok/s, TTFT p50/p99, store loads per second,
bytes read from each store, host evictions, prefetches; then cost+prefetch / lru ratios.
A small random Llama (the step is cheap, so the store is what a miss costs).
Usage: python -m benchmarks.eviction_trace [--num-requests 400] [--concurrency 16] [--configs ...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import loraserve.lora.adapter_loader as loader_module
from benchmarks.common import bench_root, cpu_class, limit_threads, save_results
from benchmarks.server_trace import TraceShape, percentile, zipf_trace
from benchmarks.synthetic_adapters import adapter_name, write_adapters
from loraserve.demo.random_model import build_tokenizer, llama_config, save_random_model
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.async_engine import AsyncLLMEngine
from loraserve.lora.request import LoRARequest
from loraserve.sampling_params import SamplingParams

RANKS = (8, 16, 32, 64)
S3_LATENCY_S = 0.03  # first byte from an object store
S3_BANDWIDTH = 25e6  # bytes/s of one stream
CONFIGS = {"lru": ("lru", False), "lru+prefetch": ("lru", True), "cost+prefetch": ("cost", True)}
SHAPE = dict(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
             num_key_value_heads=8, max_position_embeddings=256)  # fmt: skip


def adapter_place(index: int) -> tuple[int, str]:
    """(rank, store) of adapter `index`: ranks cycle, and every other pair of adapters is on the slow store."""
    return RANKS[index % len(RANKS)], "s3" if (index // 2) % 2 else "local"


@dataclass(slots=True)
class StoreReads:
    """Reads the engine made, by store: count and bytes (the weights file)."""

    reads: dict[str, int] = field(default_factory=lambda: {"local": 0, "s3": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"local": 0, "s3": 0})
    lock: threading.Lock = field(default_factory=threading.Lock)


@contextmanager
def slow_store(s3_root: str, reads: StoreReads) -> Iterator[None]:
    """Every adapter read under `s3_root` waits like an object store first; all reads are counted."""
    real = loader_module.read_adapter

    def read(folder: Any, *args: Any, **kwargs: Any) -> Any:
        size = os.path.getsize(os.path.join(folder, "adapter_model.safetensors"))
        store = "s3" if str(folder).startswith(s3_root + os.sep) else "local"
        with reads.lock:
            reads.reads[store] += 1
            reads.bytes[store] += size
        if store == "s3":
            time.sleep(S3_LATENCY_S + size / S3_BANDWIDTH)
        return real(folder, *args, **kwargs)

    loader_module.read_adapter = read  # type: ignore[assignment]
    try:
        yield
    finally:
        loader_module.read_adapter = real


def build_assets(trace: list[tuple[int, list[int]]]) -> tuple[str, dict[int, LoRARequest], str]:
    """The model, a LoRARequest per adapter of the trace, and the slow store's folder."""
    root = os.path.join(bench_root(), "eviction-trace")
    model = os.path.join(root, "model")
    if not os.path.exists(os.path.join(model, "config.json")):
        shutil.rmtree(model, ignore_errors=True)
        build_tokenizer(model)
        save_random_model(model, llama_config(512, **SHAPE), seed=0)
    requests = {}
    for index in sorted({i for i, _ in trace}):
        rank, store = adapter_place(index)
        folder_root = os.path.join(root, store, f"r{rank}")
        write_adapters(model, folder_root, [index], rank=rank)
        requests[index] = LoRARequest(
            adapter_name(index), index + 1, os.path.join(folder_root, adapter_name(index))
        )
    return model, requests, os.path.join(root, "s3")


async def replay(
    engine: AsyncLLMEngine,
    trace: list[tuple[int, list[int]]],
    requests: dict[int, LoRARequest],
    shape: TraceShape,
) -> tuple[float, list[float], int]:
    """Closed loop; (seconds, TTFTs in ms, generated tokens)."""
    params = SamplingParams(max_tokens=shape.max_tokens, ignore_eos=True, temperature=0.0)
    pending = iter(enumerate(trace))
    ttfts: list[float] = []
    tokens = 0

    async def client() -> None:
        nonlocal tokens
        for n, (index, prompt) in pending:
            begin, first = time.perf_counter(), None
            async for output in engine.generate(prompt, params, f"req-{n}", requests[index]):
                if first is None and output.outputs and output.outputs[0].token_ids:
                    first = time.perf_counter()
                if output.finished:
                    tokens += len(output.outputs[0].token_ids)
            ttfts.append(1000 * ((first or time.perf_counter()) - begin))

    begin = time.perf_counter()
    await asyncio.gather(*(client() for _ in range(shape.concurrency)))
    return time.perf_counter() - begin, ttfts, tokens


def run_config(
    name: str,
    model: str,
    trace: list[tuple[int, list[int]]],
    requests: dict[int, LoRARequest],
    s3_root: str,
    shape: TraceShape,
    max_loras: int,
    max_cpu_loras: int,
) -> dict[str, Any]:
    policy, prefetch = CONFIGS[name]
    os.environ["LORASERVE_LORA_PREFETCH"] = "1" if prefetch else "0"
    os.environ["LORASERVE_LORA_RESOLVER_S3_CACHE_DIR"] = s3_root
    reads = StoreReads()
    engine = AsyncLLMEngine.from_engine_args(EngineArgs(
        model=model, dtype="float32", enable_lora=True, max_loras=max_loras, max_cpu_loras=max_cpu_loras,
        max_lora_rank=max(RANKS), lora_eviction_policy=policy, max_num_seqs=shape.concurrency,
        kv_cache_memory_bytes=64 << 20))  # fmt: skip

    async def run() -> tuple[float, list[float], int]:
        await engine.start()
        try:
            return await replay(engine, trace, requests, shape)
        finally:
            await engine.shutdown()

    with slow_store(s3_root, reads):
        seconds, ttfts, tokens = asyncio.run(run())
    assert engine.engine.lora is not None
    stats = engine.engine.lora.stats()
    num_reads = sum(reads.reads.values())
    return {
        "config": name, "wall_s": seconds, "gen_tok_per_s": tokens / seconds,
        "ttft_p50_ms": percentile(ttfts, 0.5), "ttft_p99_ms": percentile(ttfts, 0.99),
        "loads_per_s": num_reads / seconds, "store_reads": dict(reads.reads), "store_bytes": dict(reads.bytes),
        "host_evictions": stats["lora_num_host_evictions"], "prefetches": stats.get("lora_num_prefetches", 0),
        "distinct_adapters": len({i for i, _ in trace}),
    }  # fmt: skip


def print_header() -> None:
    print(f"{'config':<15}{'tok/s':>8}{'TTFT p50':>10}{'p99':>9}{'loads/s':>9}{'reads local/s3':>16}"
          f"{'MB local/s3':>14}{'evicted':>9}{'prefetched':>11}")  # fmt: skip


def print_row(r: dict[str, Any]) -> None:
    mb = r["store_bytes"]
    print(f"{r['config']:<15}{r['gen_tok_per_s']:>8.1f}{r['ttft_p50_ms']:>8.0f}ms{r['ttft_p99_ms']:>7.0f}ms"
              f"{r['loads_per_s']:>9.2f}{r['store_reads']['local']:>8}/{r['store_reads']['s3']:<7}"
              f"{mb['local'] / 1e6:>7.1f}/{mb['s3'] / 1e6:<6.1f}{r['host_evictions']:>9}{r['prefetches']:>11}",
              flush=True)  # fmt: skip


def ratios(rows: list[dict[str, Any]], new: str = "cost+prefetch", old: str = "lru") -> dict[str, float]:
    by = {r["config"]: r for r in rows}
    if new not in by or old not in by:
        return {}
    a, b = by[new], by[old]
    return {
        "throughput": a["gen_tok_per_s"] / b["gen_tok_per_s"],
        "ttft_p50": a["ttft_p50_ms"] / b["ttft_p50_ms"],
        "ttft_p99": a["ttft_p99_ms"] / b["ttft_p99_ms"],
        "loads_per_s": a["loads_per_s"] / b["loads_per_s"],
        "store_bytes": sum(a["store_bytes"].values()) / sum(b["store_bytes"].values()),
        "s3_bytes": a["store_bytes"]["s3"] / max(b["store_bytes"]["s3"], 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--num-requests", type=int, default=400)
    parser.add_argument("--num-adapters", type=int, default=1000)
    parser.add_argument("--zipf-s", type=float, default=1.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-loras", type=int, default=8)
    parser.add_argument("--max-cpu-loras", type=int, default=32)
    parser.add_argument("--configs", default=",".join(CONFIGS), help=f"of {list(CONFIGS)}")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="the trace's seed")
    parser.add_argument("--out", default="eviction_trace", help="results file name in benchmarks/results/")
    args = parser.parse_args()
    limit_threads(args.threads)
    shape = TraceShape(
        args.num_requests, args.num_adapters, args.zipf_s, args.concurrency, 16, args.max_tokens, args.seed
    )
    trace = zipf_trace(shape)
    model, requests, s3_root = build_assets(trace)
    print(f"{cpu_class()}; {shape.num_requests} requests, Zipf s={shape.zipf_s} over {shape.num_adapters} adapters "
          f"({len(requests)} used), ranks {RANKS}, half on a store of {S3_LATENCY_S * 1e3:.0f} ms + "
          f"{S3_BANDWIDTH / 1e6:.0f} MB/s; {args.concurrency} clients, {args.max_loras} slots, "
          f"{args.max_cpu_loras} in host memory")  # fmt: skip
    rows = []
    print_header()
    for name in args.configs.split(","):
        rows.append(
            run_config(name, model, trace, requests, s3_root, shape, args.max_loras, args.max_cpu_loras)
        )
        print_row(rows[-1])
    result = ratios(rows)
    if result:
        print("cost+prefetch / lru: " + ", ".join(f"{k} {v:.2f}x" for k, v in result.items()))
    save_results(args.out, {"cpu": cpu_class(), "args": vars(args), "rows": rows, "ratios": result})


if __name__ == "__main__":
    main()
