"""The benchmark figure: (a) generated tok/s against distinct adapters, loraserve beside PEFT; (b) decode
step time against context length, loraserve beside transformers; (c) where saved, decode tok/s against
batch size on a GGUF file, loraserve (quantized and dequantized) beside llama.cpp. Needs the `bench`
extra (matplotlib).

Run alone it plots the saved results of benchmarks.adapter_curve, benchmarks.long_context and
benchmarks.beside_llama_cpp.
Usage: python -m benchmarks.plot [--out benchmarks/results/summary.png]
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Any

RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def _series(points: dict[Any, float]) -> tuple[list[int], list[float]]:
    """Sorted (x, y) lists; JSON round trips turn the int keys into strings."""
    pairs = sorted((int(x), float(y)) for x, y in points.items())
    return [x for x, _ in pairs], [y for _, y in pairs]


def _adapter_panel(ax: Any, adapters: dict[str, dict[Any, float]]) -> None:
    from matplotlib.ticker import NullFormatter

    counts: set[int] = set()
    for system, label, marker in (("loraserve", "loraserve", "o"), ("peft", "PEFT", "s")):
        xs, ys = _series(adapters.get(system, {}))
        if xs:
            ax.plot(xs, ys, marker=marker, label=label)
            counts.update(xs)
    ax.set_xscale("log", base=2)
    ax.set_xticks(sorted(counts), [str(count) for count in sorted(counts)])  # the measured counts, as numbers
    ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set_xlabel("distinct adapters in the workload")
    ax.set_ylabel("generated tokens / s")
    ax.set_title("(a) multi-LoRA throughput")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()


def _context_panel(ax: Any, long_context: dict[Any, dict[str, float]]) -> None:
    for key, label, marker in (("loraserve_ms", "loraserve", "o"), ("transformers_ms", "transformers", "s")):
        xs, ys = _series({ctx: row[key] for ctx, row in long_context.items() if key in row})
        if xs:
            ax.plot(xs, ys, marker=marker, label=label)
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("decode step (ms)")
    ax.set_title("(b) decode step at long contexts")
    ax.set_ylim(bottom=0)
    ax.grid(True, alpha=0.3)
    ax.legend()


def _batch_panel(ax: Any, sweep: dict[str, dict[Any, float]], threads: Any) -> None:
    for (system, points), marker in zip(sweep.items(), "o^s", strict=False):
        xs, ys = _series(points)
        ax.plot(xs, ys, marker=marker, label=system)
    ax.set_xscale("log", base=2)
    batches = sorted({int(x) for points in sweep.values() for x in points})
    ax.set_xticks(batches, [str(b) for b in batches])
    ax.set_xlabel("concurrent sequences")
    ax.set_ylabel("generated tokens / s")
    each = f", {threads} thread(s) each" if threads else ""
    ax.set_title(f"(c) SmolLM2-135M Q4_1 GGUF beside llama.cpp{each}")
    ax.set_ylim(bottom=0)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="small")


def make_plot(results: dict[str, Any], out_path: str) -> str:
    """Write the two-panel PNG for `results`:
    {"adapters": {"loraserve": {n: tok_s}, "peft": {n: tok_s}},
     "long_context": {ctx: {"loraserve_ms": .., "transformers_ms": ..}}, "cpu": "...", "dtype": "..."}
    and optionally "threads" (shown in the title) and "decode_sweep" ({system: {batch: tok_s}}, a third
    panel). Either of the first two panels' data may be missing (an empty panel). Returns `out_path`."""
    import matplotlib

    matplotlib.use("Agg")  # no display needed
    import matplotlib.pyplot as plt

    sweep = results.get("decode_sweep")
    fig, axes = plt.subplots(1, 3 if sweep else 2, figsize=(18 if sweep else 12, 4.8))
    _adapter_panel(axes[0], results.get("adapters", {}))
    _context_panel(axes[1], results.get("long_context", {}))
    if sweep:
        _batch_panel(axes[2], sweep, results.get("decode_sweep_threads"))
    threads = f", {results['threads']} thread(s)" if results.get("threads") else ""
    fig.suptitle(f"loraserve on {results.get('cpu', 'CPU')}{threads}, {results.get('dtype', '')} "
                 "(SmolLM-135M-shaped model)")
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(out_path)), exist_ok=True)
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    return out_path


def load_saved_results(results_dir: str = RESULTS_DIR) -> dict[str, Any]:
    """make_plot's input from adapter_curve.json and long_context.json, where they exist."""
    results: dict[str, Any] = {}
    for name, key, field in (("adapter_curve", "adapters", "adapters"), ("long_context", "long_context", "steps_ms")):
        path = os.path.join(results_dir, f"{name}.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as f:
                saved = json.load(f)
            results[key] = saved[field]
            results.setdefault("cpu", saved.get("cpu", "CPU"))
            results.setdefault("dtype", saved.get("dtype", ""))
            results.setdefault("threads", saved.get("args", {}).get("threads"))
    # the run with the sweep: beside_llama_cpp saves per thread count (beside_llama_cpp_{threads}t.json)
    names = sorted(f for f in os.listdir(results_dir) if f.startswith("beside_llama_cpp") and f.endswith(".json"))
    for name in names:
        with open(os.path.join(results_dir, name), encoding="utf-8") as f:
            beside = json.load(f)
        if beside.get("decode_sweep"):
            results["decode_sweep"] = beside["decode_sweep"]
            results["decode_sweep_threads"] = beside.get("threads")
            break
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=os.path.join(RESULTS_DIR, "summary.png"))
    parser.add_argument("--results-dir", default=RESULTS_DIR)
    args = parser.parse_args()
    results = load_saved_results(args.results_dir)
    if not results:
        raise SystemExit(f"no adapter_curve.json or long_context.json in {args.results_dir}: run those first")
    print(make_plot(results, args.out))


if __name__ == "__main__":
    main()
