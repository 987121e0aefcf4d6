"""The measurement rules every benchmark follows: what a saved result records about the machine it ran
on, and when a result is not worth saving.

On this project's 2-core machines a second busy process turns an OpenMP step into a wait on a
descheduled sibling: a figure taken beside a neighbour measures the neighbour. So each run records
- the CPU class (model, `lscpu` family and model, the vector extensions that pick our code paths),
- the thread count,
- the load average when the process started and when the result is saved,
- the memory read bandwidth measured in the same run (on the run's threads, and on one thread),
prints them with the result, and saves them beside it (`conditions` in the JSON).

A run whose 1-minute load average at its start exceeded `MAX_START_LOAD` (1.5) is refused: its figures
are printed, and every result it would save is left unsaved, with a line saying why. `--allow-busy` on any benchmark's command line
(or LORASERVE_BENCH_ALLOW_BUSY=1) saves it anyway, marked `"busy": true`.

`benchmarks/__init__.py` calls `start()` when the package is imported, which for `python -m
benchmarks.NAME` is before anything else runs; `common.save_results` calls `conditions()`.
"""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass
from typing import Any

MAX_START_LOAD = 1.5
ALLOW_BUSY_FLAG = "--allow-busy"


@dataclass(slots=True)
class _Run:
    started: float
    load_before: tuple[float, float, float]
    allow_busy: bool
    bandwidth_gbs: dict[str, float]


_run: _Run | None = None


def load_average() -> tuple[float, float, float]:
    """The 1, 5 and 15-minute load averages (zeros where /proc is missing)."""
    try:
        with open("/proc/loadavg", encoding="ascii") as f:
            one, five, fifteen = (float(x) for x in f.read().split()[:3])
    except (OSError, ValueError):
        return (0.0, 0.0, 0.0)
    return (one, five, fifteen)


def start(argv: list[str] | None = None) -> None:
    """Record the load average at the run's start (once per process) and take `--allow-busy` off the
    command line, so each benchmark's own parser never sees it."""
    global _run
    argv = sys.argv if argv is None else argv
    allow = os.environ.get("LORASERVE_BENCH_ALLOW_BUSY", "") not in ("", "0")
    if ALLOW_BUSY_FLAG in argv:
        argv.remove(ALLOW_BUSY_FLAG)
        allow = True
    if _run is None:
        _run = _Run(time.time(), load_average(), allow, {})
    elif allow:
        _run.allow_busy = True


def record_bandwidth(label: str, gbs: float) -> None:
    """A bandwidth the benchmark measured itself (so `conditions` does not measure it again)."""
    start()
    assert _run is not None
    _run.bandwidth_gbs[label] = round(gbs, 2)


def cpu_identity() -> dict[str, str]:
    """Model name, `lscpu`'s family and model numbers, and the extensions our kernels dispatch on."""
    from loraserve.native.build import cpu_flags

    fields = {"model name": "unknown CPU", "cpu family": "?", "model": "?"}
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in fields and fields[key] in ("unknown CPU", "?"):
                    fields[key] = value.strip()
                if not line.strip():
                    break
    except OSError:
        pass
    flags = cpu_flags()
    found = [
        name
        for flag, name in (
            ("avx2", "AVX2"),
            ("avx512f", "AVX-512"),
            ("avx512_vnni", "VNNI"),
            ("avx512_bf16", "AVX512-BF16"),
            ("amx_bf16", "AMX"),
        )
        if flag in flags
    ]
    return {
        "model": fields["model name"],
        "family": fields["cpu family"],
        "model_number": fields["model"],
        "extensions": " + ".join(found) or "no AVX2",
        "cores": str(os.cpu_count()),
    }


def describe_cpu() -> str:
    """One line naming the CPU class, e.g. 'AMD EPYC, family 25 model 1, AVX2'."""
    cpu = cpu_identity()
    return f"{cpu['model']}, family {cpu['family']} model {cpu['model_number']}, {cpu['extensions']}"


def _measure_bandwidth() -> None:
    import torch

    from benchmarks.bandwidth import probe_buffer, read_once_gbs

    assert _run is not None
    threads = torch.get_num_threads()
    data = probe_buffer()
    if f"{threads} threads" not in _run.bandwidth_gbs:
        _run.bandwidth_gbs[f"{threads} threads"] = round(max(read_once_gbs(data) for _ in range(3)), 2)
    if threads > 1 and "1 thread" not in _run.bandwidth_gbs:
        torch.set_num_threads(1)
        try:
            _run.bandwidth_gbs["1 thread"] = round(max(read_once_gbs(data) for _ in range(3)), 2)
        finally:
            torch.set_num_threads(threads)
    del data


def conditions() -> dict[str, Any]:
    """What a saved result records about its run; measures the bandwidth if the run did not."""
    import torch

    start()
    assert _run is not None
    if not _run.bandwidth_gbs:
        _measure_bandwidth()
    return {
        "cpu": describe_cpu(),
        "cpu_identity": cpu_identity(),
        "threads": torch.get_num_threads(),
        "load_before": list(_run.load_before),
        "load_after": list(load_average()),
        "read_bandwidth_gbs": dict(_run.bandwidth_gbs),
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z", time.localtime(_run.started)),
        "seconds": round(time.time() - _run.started, 1),
        "busy": _run.load_before[0] > MAX_START_LOAD,
        "max_start_load": MAX_START_LOAD,
    }


def check_and_print(name: str, cond: dict[str, Any]) -> bool:
    """Print the run's conditions; False when the result must not be saved (a busy start, not allowed)."""
    bandwidth = ", ".join(f"{v} GB/s on {k}" for k, v in cond["read_bandwidth_gbs"].items())
    print(
        f"[{name}] {cond['cpu']}; {cond['threads']} threads; read bandwidth {bandwidth}; "
        f"load average before {cond['load_before'][0]:.2f}, after {cond['load_after'][0]:.2f}"
    )
    if not cond["busy"]:
        return True
    assert _run is not None
    if _run.allow_busy:
        print(
            f"[{name}] saved although the load average at the start was {cond['load_before'][0]:.2f} "
            f"(> {MAX_START_LOAD}, {ALLOW_BUSY_FLAG}): the result is marked busy"
        )
        return True
    print(
        f"[{name}] NOT SAVED: the 1-minute load average at the start was {cond['load_before'][0]:.2f} "
        f"(> {MAX_START_LOAD}); figures taken beside other work measure it. Rerun on a quiet machine "
        f"(../shared/tools/quiet), or pass {ALLOW_BUSY_FLAG} to save it marked busy."
    )
    return False
