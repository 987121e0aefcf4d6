"""The benchmarks' measurement rules (benchmarks/measure.py): every saved result records its run's
conditions, and a run that started on a busy machine is not saved unless asked."""

from __future__ import annotations

import json
import os

import pytest

from benchmarks import common, measure


@pytest.fixture()
def fresh_run(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """A run of its own (the process's is shared by every import) saving under tmp_path, with a known
    bandwidth so nothing reads a gigabyte."""
    monkeypatch.setattr(measure, "_run", None)
    monkeypatch.delenv("LORASERVE_BENCH_ALLOW_BUSY", raising=False)
    monkeypatch.setattr(common, "RESULTS_DIR", str(tmp_path / "results"))


def start_at(monkeypatch: pytest.MonkeyPatch, load: float, argv: list[str]) -> None:
    monkeypatch.setattr(measure, "load_average", lambda: (load, load, load))
    measure.start(argv)
    measure.record_bandwidth("2 threads", 31.3)


def saved(tmp_path) -> dict:
    with open(os.path.join(tmp_path, "results", "x.json"), encoding="utf-8") as f:
        return json.load(f)


def test_a_quiet_run_saves_its_conditions(fresh_run, monkeypatch, tmp_path, capsys) -> None:
    start_at(monkeypatch, 0.4, ["bench"])
    assert common.save_results("x", {"tok_per_s": 1.0})
    data = saved(tmp_path)
    cond = data["conditions"]
    assert data["tok_per_s"] == 1.0
    assert cond["load_before"] == [0.4, 0.4, 0.4] and len(cond["load_after"]) == 3
    assert cond["read_bandwidth_gbs"] == {"2 threads": 31.3}
    assert cond["threads"] >= 1 and cond["busy"] is False
    assert "family" in cond["cpu"] and cond["cpu_identity"]["family"]
    printed = capsys.readouterr().out
    assert "31.3 GB/s" in printed and "load average before 0.40" in printed


def test_a_busy_run_is_not_saved(fresh_run, monkeypatch, tmp_path, capsys) -> None:
    start_at(monkeypatch, measure.MAX_START_LOAD + 0.5, ["bench"])
    assert not common.save_results("x", {"tok_per_s": 1.0})
    assert not os.path.exists(os.path.join(tmp_path, "results", "x.json"))
    assert "NOT SAVED" in capsys.readouterr().out


def test_allow_busy_saves_it_marked(fresh_run, monkeypatch, tmp_path) -> None:
    argv = ["bench", "--threads", "2", measure.ALLOW_BUSY_FLAG]
    start_at(monkeypatch, measure.MAX_START_LOAD + 0.5, argv)
    assert argv == ["bench", "--threads", "2"]  # the benchmark's own parser never sees the flag
    assert common.save_results("x", {})
    assert saved(tmp_path)["conditions"]["busy"] is True
