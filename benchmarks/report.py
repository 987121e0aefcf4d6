"""docs/performance.md's results section, rendered from the saved results (benchmarks/results/*.json).

Only results that record their run's conditions (benchmarks/measure.py: CPU class, threads, load
average before and after, read bandwidth) are rendered, each table under the file it came from, so
every figure in the docs names its saved result. `python -m benchmarks.report` prints the section;
`--write` replaces it in docs/performance.md between its markers (tests/benchmarks/test_report.py keeps
the page equal to what the committed results render).
"""

from __future__ import annotations

import argparse
import glob
import json
import os
from collections.abc import Callable
from typing import Any

from benchmarks.common import RESULTS_DIR

DOC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "docs", "performance.md")
BEGIN, END = "<!-- results:begin (python -m benchmarks.report --write) -->", "<!-- results:end -->"


def conditions_line(cond: dict[str, Any]) -> str:
    bandwidth = ", ".join(f"{v} GB/s on {k}" for k, v in cond["read_bandwidth_gbs"].items())
    busy = " **(started busy: saved with --allow-busy)**" if cond.get("busy") else ""
    return (
        f"{cond['cpu']}; {cond['threads']} thread(s); read bandwidth {bandwidth}; load average "
        f"{cond['load_before'][0]:.2f} before, {cond['load_after'][0]:.2f} after; {cond['started']}{busy}"
    )


def bound_text(row: dict[str, Any], peak: float | None) -> str:
    """A row's machine bound: one sequence's weight-read bound, or the int8 multiply-adds a second the
    linears ran at as a share of the int8 peak measured in the same run (report.py prints it too)."""
    if "bound" in row:
        return f"bound {row['bound']:.1f} tok/s: step {row['bound'] / row['loraserve']:.2f}x"
    if "int8_gmacs" in row and peak:
        return f"linears {row['int8_gmacs']:.0f} G MAC/s: {row['int8_gmacs'] / peak:.0%} of the int8 peak"
    return ""


def _beside_llama_cpp(data: dict[str, Any]) -> list[str]:
    lines = [
        "| file | row | loraserve tok/s | llama.cpp tok/s | ratio | machine bound |",
        "|---|---|---|---|---|---|",
    ]
    peak = data.get("int8_peak_gmacs")
    for entry in data["files"].values():
        for label, row in entry["rows"].items():
            ours, theirs = row["loraserve"], row["llama.cpp"]
            bound = bound_text(row, peak)
            lines.append(
                f"| {entry['file']} | {label} | {ours:.1f} | {theirs:.1f} | {ours / theirs:.2f}x | {bound} |"
            )
    return lines


def _rss_after_load(data: dict[str, Any]) -> list[str]:
    lines = ["| file | limit: (file + KV) x 1.1, MB | loraserve after load / first request | "
             "llama.cpp after load / first request |", "|---|---|---|---|"]  # fmt: skip
    for e in data["files"].values():
        ours, theirs = e["loraserve"], e.get("llama.cpp")
        them = f"{theirs['load_mb']:.0f} / {theirs['first_request_mb']:.0f}" if theirs else ""
        lines.append(f"| {e['file']} | ({e['file_mb']:.0f} + {e['kv_mb']:.0f}) x 1.1 = {e['limit_mb']:.0f} | "
                     f"{ours['load_mb']:.0f} / {ours['first_request_mb']:.0f} | {them} |")  # fmt: skip
    return lines


def _ratio(row: dict[str, Any]) -> str:
    """A bound ratio, or why there is none: a short-context step slower than the long one measured
    something other than the KV read (the run's first steps of a new engine), so it bounds nothing."""
    return f"{row['ratio']:.2f}x" if row["extra_ms"] > 0 else "none: the short step was the slower"


def _long_context(data: dict[str, Any]) -> list[str]:
    lines = ["| context | loraserve ms/step | transformers ms/step |", "|---|---|---|"]
    for context, row in data["steps_ms"].items():
        lines.append(
            f"| {context} | {row['loraserve_ms']:.1f} | {row.get('transformers_ms', float('nan')):.1f} |"
        )
    lines += [
        "",
        "| KV-read bound | ms short | ms long | extra ms | bound ms (GB/s) | ratio |",
        "|---|---|---|---|---|---|",
    ]
    for name, row in data.get("kv_bound", {}).items():
        lines.append(f"| {name} | {row['short_ms']:.1f} | {row['long_ms']:.1f} | {row['extra_ms']:.1f} | "
                     f"{row['bound_ms']:.1f} ({row['read_gbs']:.1f}) | {_ratio(row)} |")  # fmt: skip
    return lines


def _speculative(data: dict[str, Any]) -> list[str]:
    """benchmarks/speculative.py: each row's tok/s with speculation off and on, beside llama-server's."""
    spec = data.get("llama_cpp") or "not run"
    lines = [f"ngram, k={data['k']}, lookup {data['lookup']}; llama-server: {spec}", "",
             "| row | off tok/s | ngram tok/s | ratio | target | ngram bound: rows free / at step costs "
             "| llama.cpp tok/s | llama.cpp ngram tok/s | ratio |",
             "|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for label, row in data["rows"].items():
        target = data.get("targets", {}).get(label)
        theirs, their_spec = row.get("llama.cpp"), row.get("llama.cpp ngram")
        their = (
            f"{theirs:.1f} | {their_spec:.1f} | {their_spec / theirs:.2f}x"
            if theirs and their_spec
            else "| |"
        )
        bound = f"{row['bound']:.2f}x / {row['bound_at_costs']:.2f}x" if "bound" in row else ""
        lines.append(f"| {label} | {row['off']:.1f} | {row['ngram']:.1f} | {row['ngram'] / row['off']:.2f}x | "
                     f"{'>= ' + str(target) + 'x' if target else ''} | {bound} | {their} |")  # fmt: skip
    steps = data.get("step_ms_by_rows")
    if steps:  # the engine's measured step cost by token rows, speculation on (what its plan weighs)
        lines += ["", "Step ms by token rows (speculation on): "
                  + ", ".join(f"{rows}: {ms}" for rows, ms in sorted(steps.items(), key=lambda kv: int(kv[0])))]  # fmt: skip
    return lines


def _flat(data: dict[str, Any]) -> list[str]:
    """Any other result: its numbers, one row each (nested keys joined by ' / ')."""
    rows: list[str] = ["| figure | value |", "|---|---|"]

    def walk(prefix: str, value: Any) -> None:
        if isinstance(value, dict):
            for key, inner in value.items():
                if key not in ("conditions", "args", "cpu"):
                    walk(f"{prefix} / {key}" if prefix else str(key), inner)
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            rows.append(f"| {prefix} | {value:.4g} |")

    walk("", data)
    return rows


RENDERERS: dict[str, Callable[[dict[str, Any]], list[str]]] = {
    "beside_llama_cpp": _beside_llama_cpp,
    "long_context": _long_context,
    "rss_after_load": _rss_after_load,
    "speculative": _speculative,
}


def render(results_dir: str = RESULTS_DIR) -> str:
    """The results section: every saved result with conditions, by file name."""
    out = [
        BEGIN,
        "",
        "Rendered by `python -m benchmarks.report --write` from `benchmarks/results/`; every",
        "table names its file and the conditions of the run that wrote it.",
        "",
    ]
    for path in sorted(glob.glob(os.path.join(results_dir, "*.json"))):
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
        if "conditions" not in data:
            continue
        name = os.path.basename(path)
        renderer = next((fn for prefix, fn in RENDERERS.items() if name.startswith(prefix)), _flat)
        out += [f"### `{name}`", "", conditions_line(data["conditions"]), "", *renderer(data), ""]
    return "\n".join([*out, END])


def write(doc: str = DOC) -> None:
    with open(doc, encoding="utf-8") as f:
        text = f.read()
    start, end = text.index(BEGIN), text.index(END) + len(END)
    with open(doc, "w", encoding="utf-8") as f:
        f.write(text[:start] + render() + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="replace the section in docs/performance.md")
    args = parser.parse_args()
    if args.write:
        write()
    else:
        print(render())


if __name__ == "__main__":
    main()
