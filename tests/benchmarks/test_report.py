"""docs/performance.md quotes only what the saved results say: its results section is what
benchmarks.report renders from benchmarks/results/, and every saved result records its conditions."""

from __future__ import annotations

import glob
import json
import os

from benchmarks import report
from benchmarks.common import RESULTS_DIR


def test_the_docs_section_is_the_rendered_results() -> None:
    with open(report.DOC, encoding="utf-8") as f:
        text = f.read()
    section = text[text.index(report.BEGIN) : text.index(report.END) + len(report.END)]
    assert section == report.render(), "docs/performance.md is stale: python -m benchmarks.report --write"


def test_every_saved_result_records_its_conditions() -> None:
    for path in glob.glob(os.path.join(RESULTS_DIR, "*.json")):
        with open(path, encoding="utf-8") as f:
            cond = json.load(f).get("conditions")
        assert cond is not None, f"{os.path.basename(path)} has no run conditions (benchmarks/measure.py)"
        assert {"cpu", "threads", "load_before", "load_after", "read_bandwidth_gbs"} <= set(cond)
        assert cond["read_bandwidth_gbs"], os.path.basename(path)


def test_a_result_renders_under_its_file_with_its_conditions(tmp_path) -> None:
    cond = {
        "cpu": "AMD EPYC, family 25 model 1, AVX2",
        "threads": 2,
        "load_before": [0.3, 0, 0],
        "load_after": [1.9, 0, 0],
        "read_bandwidth_gbs": {"2 threads": 31.3},
        "started": "2026-12-06",
    }
    data = {
        "files": {
            "f": {
                "file": "x.gguf",
                "rows": {
                    "one sequence": {"loraserve": 30.0, "llama.cpp": 24.0, "bound": 36.0},
                    "prompt processing": {"loraserve": 100.0, "llama.cpp": 80.0, "int8_gmacs": 150.0},
                },
            }
        },
        "int8_peak_gmacs": 300.0,
        "conditions": cond,
    }
    (tmp_path / "beside_llama_cpp_2t.json").write_text(json.dumps(data))
    (tmp_path / "old.json").write_text(json.dumps({"tok_per_s": 1.0}))  # no conditions: left out
    text = report.render(str(tmp_path))
    assert "### `beside_llama_cpp_2t.json`" in text and "old.json" not in text
    assert "31.3 GB/s on 2 threads" in text and "load average 0.30 before, 1.90 after" in text
    assert "| x.gguf | one sequence | 30.0 | 24.0 | 1.25x | bound 36.0 tok/s: step 1.20x |" in text
    assert "| prompt processing | 100.0 | 80.0 | 1.25x | linears 150 G MAC/s: 50% of the int8 peak |" in text


def test_the_speculative_result_renders_its_ratios_and_targets(tmp_path) -> None:
    cond = {
        "cpu": "AMD EPYC, family 25 model 1, AVX2",
        "threads": 1,
        "load_before": [0.2, 0, 0],
        "load_after": [1.1, 0, 0],
        "read_bandwidth_gbs": {"1 threads": 17.0},
        "started": "2026-12-06",
    }
    data = {"k": 8, "lookup": [2, 5], "llama_cpp": "--spec-type ngram-simple", "targets": {"edit": 2.0, "chat": 0.97},
            "rows": {"edit": {"off": 50.0, "ngram": 125.0, "llama.cpp": 40.0, "llama.cpp ngram": 80.0, "tokens": [60],
                              "bound": 2.7, "bound_at_costs": 2.2},
                     "chat": {"off": 50.0, "ngram": 49.0, "tokens": [200]}},
            "conditions": cond}  # fmt: skip
    (tmp_path / "speculative.json").write_text(json.dumps(data))
    text = report.render(str(tmp_path))
    assert "ngram, k=8, lookup [2, 5]; llama-server: --spec-type ngram-simple" in text
    assert "| edit | 50.0 | 125.0 | 2.50x | >= 2.0x | 2.70x / 2.20x | 40.0 | 80.0 | 2.00x |" in text
    assert "| chat | 50.0 | 49.0 | 0.98x | >= 0.97x |  | | | |" in text  # no bound, no llama.cpp: empty cells
