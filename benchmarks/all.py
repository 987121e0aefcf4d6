"""Every performance figure of the project in one run, and the targets they are held to.

Runs, in one process (the server trace in a child server), on the SmolLM-135M-shaped random model:
base throughput against transformers and the linear-only ceiling; one adapter, 16 mixed and 64
distinct adapters (max_loras 16) against the base, PEFT's mixed batch, and the cold-adapter first
token; the decode step at long contexts against transformers; a live server under a Zipf trace
over 1000 adapters against 8; the throughput curve over distinct adapters; the host adapter cache's
hit rate on a random trace over 12 adapters with 8 cached (a tiny model); structured outputs on
SmolLM2 (32 JSON-schema requests against 32 unconstrained, a new schema's compile); beam search
(width 4, 16 prompts) against transformers' generate(num_beams=4). Prints one table with
each ratio beside its target, saves benchmarks/results/all.json and draws the README's plot.
Usage: python -m benchmarks.all [--dtype auto] [--threads N] [--quick] [--skip-server] [--plot PATH]
  [--with-admission]  (also the admission-wait rows of benchmarks.admission_wait: three more servers)
"""

from __future__ import annotations

import argparse
import os
import time
from typing import Any

import torch

from benchmarks.adapter_curve import adapter_curve
from benchmarks.admission_wait import MODES, AdmissionShape, print_admission_wait, run_admission_wait
from benchmarks.beam_search import run_beam_search
from benchmarks.common import (
    build_adapters,
    build_model,
    cpu_class,
    interleaved_timed,
    limit_threads,
    random_prompts,
    save_results,
)
from benchmarks.host_cache_trace import HOST_ENTRIES, NUM_ADAPTERS, run_grid
from benchmarks.long_context import model_for, run_long_context
from benchmarks.lora_throughput import first_token_latency, run_loraserve, run_peft_mixed, run_swapping
from benchmarks.plot import make_plot
from benchmarks.server_trace import TraceShape, run_server_trace
from benchmarks.structured_output import run_structured_output
from benchmarks.throughput import loraserve_run, matmul_floor_run, run_transformers
from loraserve.config import resolve_device, resolve_dtype

PLOT_PATH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "performance.png")
# (row, how the value is read, target): ">=" ratios, "<=" milliseconds.
TARGETS = [
    ("base / linear-only ceiling", ">=", 0.8),
    ("1 adapter / base", ">=", 0.95),
    ("16 adapters mixed / base", ">=", 0.9),
    ("64 distinct (max_loras=16) / base", ">=", 0.75),
    ("cold adapter first token - warm (ms)", "<=", 20.0),
    ("host hit rate, 12 adapters over 8", ">=", round(HOST_ENTRIES / NUM_ADAPTERS, 3)),  # LRU's bound
    ("json_schema / unconstrained (SmolLM2)", ">=", 0.9),
    ("new schema's compile (ms, 49k vocab)", "<=", 50.0),
]


def base_rows(dtype: torch.dtype, quick: bool) -> dict[str, float]:
    """32 requests x (64 prompt + 64 generated): transformers, then loraserve and the linear-only
    ceiling timed in turn (`interleaved_timed`: their ratio is a target)."""
    path, gen = build_model(), 16 if quick else 64
    prompts = random_prompts(32, 64, 49152)
    name = str(dtype).replace("torch.", "")
    ceiling = matmul_floor_run(path, 32, 64, gen, dtype)
    runs = {"loraserve": loraserve_run(path, 32, gen, name), "ceiling": lambda ids: ceiling()}
    rows = {"transformers": run_transformers(path, prompts, gen, dtype)}
    rows.update({key: 32 * gen / seconds for key, (seconds, _) in interleaved_timed(runs, prompts).items()})
    return rows


def lora_rows(dtype: torch.dtype, quick: bool) -> dict[str, float]:
    """32 requests x (32 + 32), rank 16 on all 7 projections: PEFT mixed, loraserve rows, cold start."""
    path, gen, name = build_model(), 16 if quick else 32, str(dtype).replace("torch.", "")
    adapters = build_adapters(path, 64)
    prompts = random_prompts(32, 32, 49152)
    rows = run_loraserve(path, adapters, prompts, gen, name, 16)
    rows["loraserve 64 distinct"] = run_swapping(path, adapters[:64], prompts, gen, name)
    rows["PEFT 16 mixed"] = run_peft_mixed(path, adapters[:16], prompts, gen, dtype)
    cold, warm = first_token_latency(path, adapters[:5], name)
    rows["cold_ms"], rows["warm_ms"] = cold * 1000, warm * 1000
    return rows


def ratios(base: dict[str, float], lora: dict[str, float]) -> dict[str, float]:
    lora_base = lora["loraserve base"]
    return {
        "base / transformers": base["loraserve"] / base["transformers"],
        "ceiling / transformers": base["ceiling"] / base["transformers"],
        "base / linear-only ceiling": base["loraserve"] / base["ceiling"],
        "1 adapter / base": lora["loraserve 1 adapter"] / lora_base,
        "16 adapters mixed / base": lora["loraserve 16 mixed"] / lora_base,
        "64 distinct (max_loras=16) / base": lora["loraserve 64 distinct"] / lora_base,
        "16 mixed / PEFT 16 mixed": lora["loraserve 16 mixed"] / lora["PEFT 16 mixed"],
        "cold adapter first token - warm (ms)": lora["cold_ms"] - lora["warm_ms"],
    }


def print_report(cpu: str, dtype: torch.dtype, results: dict[str, Any]) -> None:
    print(f"\n== {cpu}, {str(dtype).replace('torch.', '')} ==")
    base, lora = results["base"], results["lora"]
    print(f"base tok/s: transformers {base['transformers']:.1f}, loraserve {base['loraserve']:.1f}, "
          f"ceiling {base['ceiling']:.1f}")
    print("lora tok/s: " + ", ".join(f"{k} {v:.1f}" for k, v in lora.items() if not k.endswith("_ms")))
    targets = {row: (op, goal) for row, op, goal in TARGETS}
    print(f"\n{'ratio':<40}{'value':>10}{'target':>10}  held")
    for row, value in results["ratios"].items():
        op, goal = targets.get(row, ("", None))
        held = "" if goal is None else ("yes" if (value >= goal if op == ">=" else value <= goal) else "NO")
        print(f"{row:<40}{value:>10.2f}{(op + ' ' + str(goal)) if goal is not None else '':>10}  {held}")
    if "long_context" in results:
        print("\ndecode step, 16 sequences:")
        for ctx, row in results["long_context"].items():
            print(f"  context {ctx:>5}: loraserve {row['loraserve_ms']:.1f} ms, transformers "
                  f"{row['transformers_ms']:.1f} ms ({row['transformers_ms'] / row['loraserve_ms']:.2f}x)")
    if "server_trace" in results:
        many, ref = results["server_trace"]["many"], results["server_trace"]["reference"]
        for label, row in (("1000 adapters", many), ("8 adapters", ref)):
            print(f"server trace, {label}: {row['gen_tok_per_s']:.1f} tok/s, TTFT p50 {row['ttft_p50_ms']:.0f} ms, "
                  f"p99 {row['ttft_p99_ms']:.0f} ms, {row['num_failed']} failed, {row['distinct_adapters']} adapters")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="compute threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="shorter generations, two contexts, 60 requests")
    parser.add_argument("--skip-server", action="store_true")
    parser.add_argument("--with-admission", action="store_true", help="also the admission-wait rows (not default)")
    parser.add_argument("--plot", default=PLOT_PATH)
    args = parser.parse_args()
    limit_threads(args.threads)
    dtype = resolve_dtype(args.dtype, resolve_device("cpu"))
    cpu, start = cpu_class(), time.perf_counter()
    print(f"{cpu}, {dtype}", flush=True)
    results: dict[str, Any] = {"cpu": cpu, "dtype": str(dtype).replace("torch.", "")}
    results["base"] = base_rows(dtype, args.quick)
    results["lora"] = lora_rows(dtype, args.quick)
    results["ratios"] = ratios(results["base"], results["lora"])
    structured = results["structured_output"] = run_structured_output(16 if args.quick else 48)
    results["ratios"]["json_schema / unconstrained (SmolLM2)"] = structured["constrained_over_unconstrained"]
    results["ratios"]["new schema's compile (ms, 49k vocab)"] = structured["first_request_compile_ms"]
    beams = results["beam_search"] = run_beam_search(dtype, 16 if args.quick else 32)
    results["ratios"]["beam search W=4 / transformers num_beams=4"] = beams["loraserve_over_transformers"]
    contexts = [128, 1024] if args.quick else [128, 1024, 2048]
    results["long_context"] = run_long_context(model_for(contexts), dtype, contexts)
    results["adapters"] = adapter_curve(build_model(), dtype)
    results["host_cache"] = run_grid(300 if args.quick else 1200, in_flight=[8], max_loras=[2])
    results["ratios"]["host hit rate, 12 adapters over 8"] = results["host_cache"][0]["hit_rate"]
    if not args.skip_server:
        shape = TraceShape(num_requests=60) if args.quick else TraceShape()
        results["server_trace"] = run_server_trace(build_model(), dtype, shape)
    if args.with_admission:
        results["admission_wait"] = run_admission_wait(build_model(), results["dtype"], AdmissionShape(), list(MODES))
    results["seconds"] = time.perf_counter() - start
    print_report(cpu, dtype, results)
    if "admission_wait" in results:
        print_admission_wait(results["admission_wait"])
    save_results("all", results)
    print(f"\nplot: {make_plot(results, args.plot)}; {results['seconds']:.0f} s in all")


if __name__ == "__main__":
    main()
