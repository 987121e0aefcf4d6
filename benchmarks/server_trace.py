"""A live server under a Zipf-popularity trace over many adapters, against the same trace over a few.

The server (`loraserve serve` as a child process: 16 LoRA slots, 64 adapters in host memory) finds
adapters on first use through the filesystem resolver, in a folder of random rank-8 attention-only
PEFT adapters (benchmarks.synthetic_adapters; only those the trace names are written). Each request
picks adapter i with probability proportional to 1 / (i + 1) ** s, sends random prompt tokens and
streams `max_tokens` tokens (ignore_eos); `concurrency` clients each send their next request as soon
as the previous one ends (closed loop). Reported per run: generated tok/s, TTFT p50/p99, distinct
adapters used and the server's LoRA counters from /metrics. The same trace shape over 8 adapters is
the reference; the ratios say what many adapters cost.
Usage: python -m benchmarks.server_trace [--num-requests 200] [--num-adapters 1000] [--concurrency 16]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import tempfile
import time
from dataclasses import dataclass, replace
from typing import Any

import httpx
import torch

from benchmarks.common import bench_root, build_model, cpu_class, limit_threads, save_results
from benchmarks.server_process import running_server
from benchmarks.synthetic_adapters import adapter_name, write_adapters
from loraserve.config import resolve_device, resolve_dtype

REFERENCE_ADAPTERS = 8
LORA_RANK = 8


@dataclass(frozen=True, slots=True)
class TraceShape:
    num_requests: int = 200
    num_adapters: int = 1000
    zipf_s: float = 1.0
    concurrency: int = 16
    prompt_len: int = 32
    max_tokens: int = 32
    seed: int = 0


@dataclass(slots=True)
class RequestRecord:
    adapter: str
    ttft_s: float = float("nan")
    num_tokens: int = 0
    error: str = ""


def zipf_trace(shape: TraceShape) -> list[tuple[int, list[int]]]:
    """(adapter index, prompt token ids) per request; index 0 is the most popular adapter."""
    rng = random.Random(shape.seed)
    weights = [1.0 / (i + 1) ** shape.zipf_s for i in range(shape.num_adapters)]
    indices = rng.choices(range(shape.num_adapters), weights=weights, k=shape.num_requests)
    # Token ids inside the small benchmark tokenizer's vocabulary, so any prompt also detokenizes.
    return [(i, [rng.randrange(10, 500) for _ in range(shape.prompt_len)]) for i in indices]


async def send(client: httpx.AsyncClient, body: dict[str, Any]) -> RequestRecord:
    """One streamed completion; the first event with a choice marks the first token."""
    record = RequestRecord(body["model"])
    begin = time.perf_counter()
    try:
        async with client.stream("POST", "/v1/completions", json=body) as response:
            if response.status_code != 200:
                record.error = f"{response.status_code} {(await response.aread()).decode(errors='replace')[:200]}"
                return record
            async for line in response.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    record.error = str(event["error"])[:200]
                elif event.get("choices") and record.ttft_s != record.ttft_s:  # still NaN: the first
                    record.ttft_s = time.perf_counter() - begin
                if event.get("usage"):
                    record.num_tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as exc:
        record.error = f"{type(exc).__name__}: {exc}"
    return record


async def replay(url: str, trace: list[tuple[int, list[int]]], shape: TraceShape) -> tuple[float, list[RequestRecord]]:
    """Closed loop: `concurrency` clients take the trace's requests in order; (seconds, records)."""
    pending = iter(trace)
    records: list[RequestRecord] = []
    limits = httpx.Limits(max_connections=shape.concurrency, max_keepalive_connections=shape.concurrency)

    async def client_loop(client: httpx.AsyncClient) -> None:
        for index, prompt in pending:
            body = {"model": adapter_name(index), "prompt": prompt, "max_tokens": shape.max_tokens,
                    "temperature": 0.0, "ignore_eos": True, "stream": True,
                    "stream_options": {"include_usage": True}}
            records.append(await send(client, body))

    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        begin = time.perf_counter()
        await asyncio.gather(*(client_loop(client) for _ in range(shape.concurrency)))
        return time.perf_counter() - begin, records


def lora_metrics(url: str) -> dict[str, float]:
    """The server's unlabelled `loraserve:lora_*` series (loads, hits, evictions, ...)."""
    text = httpx.get(url + "/metrics", timeout=30).text
    values = {}
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name.startswith("loraserve:lora_") and "{" not in name and not name.endswith(("_created", "_bucket")):
            values[name.removeprefix("loraserve:")] = float(value)
    return values


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


def summarize(seconds: float, records: list[RequestRecord]) -> dict[str, Any]:
    done = [r for r in records if not r.error]
    ttfts = [1000 * r.ttft_s for r in done]
    return {
        "wall_s": seconds,
        "gen_tok_per_s": sum(r.num_tokens for r in done) / seconds,
        "ttft_p50_ms": percentile(ttfts, 0.5),
        "ttft_p99_ms": percentile(ttfts, 0.99),
        "num_failed": len(records) - len(done),
        "errors": sorted({r.error for r in records if r.error})[:5],
        "distinct_adapters": len({r.adapter for r in records}),
    }


def server_flags(model: str, dtype: str) -> list[str]:
    return [model, "--enable-lora", "--max-loras", "16", "--max-cpu-loras", "64",
            "--max-lora-rank", str(LORA_RANK), "--dtype", dtype]


def prepare_adapters(model: str, trace: list[tuple[int, list[int]]]) -> dict[str, str]:
    """Write the trace's adapters; the environment that lets the server resolve them by name."""
    root = os.path.join(bench_root(), f"trace-adapters-r{LORA_RANK}")
    write_adapters(model, root, (index for index, _ in trace), rank=LORA_RANK)
    return {"LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "1", "LORASERVE_PLUGINS": "lora_filesystem_resolver",
            "LORASERVE_LORA_RESOLVER_CACHE_DIR": root}


def run_trace(model: str, dtype: str, shape: TraceShape, log_path: str) -> dict[str, Any]:
    """Start a fresh server, warm it up on the base model, replay the trace; the run's summary."""
    trace = zipf_trace(shape)
    env = prepare_adapters(model, trace)
    with running_server(server_flags(model, dtype), log_path, env) as url:
        for _ in range(2):  # warm-up on the base model: no adapter is loaded before the trace
            httpx.post(url + "/v1/completions", json={"model": model, "prompt": trace[0][1], "max_tokens": 4,
                                                      "ignore_eos": True}, timeout=600).raise_for_status()
        seconds, records = asyncio.run(replay(url, trace, shape))
        result = summarize(seconds, records)
        result["lora_metrics"] = lora_metrics(url)
    return {"num_adapters": shape.num_adapters, "num_requests": shape.num_requests, **result}


def run_server_trace(model: str, dtype: str | torch.dtype, shape: TraceShape,
                     reference_adapters: int = REFERENCE_ADAPTERS, log_dir: str | None = None) -> dict[str, Any]:
    """The trace over `shape.num_adapters` adapters and (unless `reference_adapters` is 0) the same
    trace over `reference_adapters`, with the ratios many / reference."""
    dtype = str(dtype).replace("torch.", "")  # the server's --dtype
    log_dir = log_dir or tempfile.gettempdir()
    many = run_trace(model, dtype, shape, os.path.join(log_dir, "loraserve-trace-many.log"))
    if not reference_adapters:
        return {"many": many}
    few = run_trace(model, dtype, replace(shape, num_adapters=reference_adapters),
                    os.path.join(log_dir, "loraserve-trace-reference.log"))
    return {
        "many": many,
        "reference": few,
        "throughput_ratio": many["gen_tok_per_s"] / few["gen_tok_per_s"],
        "ttft_p50_ratio": many["ttft_p50_ms"] / few["ttft_p50_ms"],
        "ttft_p99_ratio": many["ttft_p99_ms"] / few["ttft_p99_ms"],
    }


def serve_only(model: str, dtype: str, shape: TraceShape, port: int) -> None:
    """The trace's server and adapters without the trace, until Ctrl-C: for another client (guidellm)."""
    env = prepare_adapters(model, zipf_trace(shape))
    log_path = os.path.join(tempfile.gettempdir(), "loraserve-trace-serve.log")
    with running_server(server_flags(model, dtype), log_path, env, port=port) as url:
        print(f"serving {model} at {url} (log: {log_path}); adapters zipf-00000 ... in "
              f"{env['LORASERVE_LORA_RESOLVER_CACHE_DIR']}; Ctrl-C stops", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            while True:
                time.sleep(3600)


def print_server_trace(result: dict[str, Any]) -> None:
    runs = [result[key] for key in ("many", "reference") if key in result]
    print(f"\n{'adapters':>9}{'distinct':>10}{'gen tok/s':>11}{'TTFT p50 ms':>13}{'TTFT p99 ms':>13}{'failed':>8}")
    for run in runs:
        print(f"{run['num_adapters']:>9}{run['distinct_adapters']:>10}{run['gen_tok_per_s']:>11.1f}"
              f"{run['ttft_p50_ms']:>13.1f}{run['ttft_p99_ms']:>13.1f}{run['num_failed']:>8}")
    if "reference" in result:
        print(f"{runs[0]['num_adapters']} / {runs[1]['num_adapters']} adapters: throughput "
              f"{result['throughput_ratio']:.2f}x, TTFT p50 {result['ttft_p50_ratio']:.2f}x, "
              f"p99 {result['ttft_p99_ratio']:.2f}x")
    for run in runs:
        counters = {k: round(v, 2) for k, v in run["lora_metrics"].items() if not k.endswith(("_sum", "_count"))}
        print(f"  server LoRA counters, {run['num_adapters']} adapters: {counters}")
        for error in run["errors"]:
            print(f"  error: {error}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = TraceShape()
    parser.add_argument("--num-requests", type=int, default=defaults.num_requests)
    parser.add_argument("--num-adapters", type=int, default=defaults.num_adapters)
    parser.add_argument("--zipf-s", type=float, default=defaults.zipf_s, help="popularity skew (1.0-1.1 typical)")
    parser.add_argument("--concurrency", type=int, default=defaults.concurrency, help="closed-loop clients")
    parser.add_argument("--prompt-len", type=int, default=defaults.prompt_len)
    parser.add_argument("--max-tokens", type=int, default=defaults.max_tokens)
    parser.add_argument("--reference-adapters", type=int, default=REFERENCE_ADAPTERS, help="0: no reference run")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="compute threads (1 on cores shared with other jobs)")
    parser.add_argument("--log-dir", default=None, help="where the servers' logs go (default: the temp folder)")
    parser.add_argument("--serve-only", action="store_true", help="start the server, run no trace (for guidellm)")
    parser.add_argument("--port", type=int, default=8000, help="with --serve-only")
    args = parser.parse_args()
    limit_threads(args.threads)
    dtype_name = str(resolve_dtype(args.dtype, resolve_device("cpu"))).replace("torch.", "")
    shape = TraceShape(args.num_requests, args.num_adapters, args.zipf_s, args.concurrency, args.prompt_len,
                       args.max_tokens)
    if args.serve_only:
        serve_only(build_model(), dtype_name, shape, args.port)
        return
    print(f"{cpu_class()}, {dtype_name}, {shape.num_requests} requests (Zipf s={shape.zipf_s}) x "
          f"({shape.prompt_len} prompt + {shape.max_tokens} generated), {shape.concurrency} clients")
    result = run_server_trace(build_model(), dtype_name, shape, args.reference_adapters, args.log_dir)
    print_server_trace(result)
    save_results("server_trace", {"cpu": cpu_class(), "dtype": dtype_name, "args": vars(args), **result})


if __name__ == "__main__":
    main()
