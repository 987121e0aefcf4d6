"""A soak run: `loraserve serve` under mixed traffic (benchmarks.soak_traffic) for minutes, with the
server's RSS sampled throughout.

The server is the demo (SmolLM2-135M-Instruct with the french, pirate and sql adapters), started as a
child process with runtime adapter loading on, so the churn worker loads and unloads copies of `sql`.
Alongside, unless --no-hostile, one worker loads the hostile adapters of benchmarks.hostile_adapters
(each must be a 400) and /health is polled every 0.1 s.
Prints (and saves under benchmarks/results/) the outcome counts, lost requests, RSS after warm-up,
at the end and at its peak, and /health's p99 and worst latency.
Usage: python -m benchmarks.soak [--duration 600] [--concurrency 12] [--dtype auto] [--max-loras 2]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import platform
import subprocess
import tempfile
import time
from typing import Any

from benchmarks.common import save_results
from benchmarks.hostile_adapters import write_hostile_adapters
from benchmarks.server_process import start_server, stop_server, wait_healthy
from benchmarks.soak_traffic import SoakPlan, run_soak_traffic

RSS_INTERVAL_S = 2.0


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status", encoding="ascii") as status:
        for line in status:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def start_soak_server(port: int, args: argparse.Namespace) -> subprocess.Popen:
    flags = ["--dtype", args.dtype, "--max-loras", str(args.max_loras), "--max-cpu-loras", str(args.max_cpu_loras)]
    return start_server(port, flags, args.log, {"LORASERVE_ALLOW_RUNTIME_LORA_UPDATING": "1"})


async def sample_rss(pid: int, samples: list[tuple[float, int]], stop: asyncio.Event) -> None:
    start = time.monotonic()
    while not stop.is_set():
        samples.append((time.monotonic() - start, rss_bytes(pid)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), RSS_INTERVAL_S)


async def soak(plan: SoakPlan, pid: int) -> tuple[Any, list[tuple[float, int]]]:
    samples: list[tuple[float, int]] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_rss(pid, samples, stop))
    try:
        tally = await run_soak_traffic(plan)
    finally:
        stop.set()
        await sampler
    return tally, samples


def rss_report(samples: list[tuple[float, int]], warmup_s: float) -> dict[str, float]:
    after = [rss for t, rss in samples if t >= warmup_s] or [samples[-1][1]]
    mib = 1 << 20
    return {
        "warmup_s": warmup_s,
        "rss_after_warmup_mib": after[0] / mib,
        "rss_end_mib": after[-1] / mib,
        "rss_peak_after_warmup_mib": max(after) / mib,
        "growth_after_warmup_pct": 100 * (after[-1] / after[0] - 1),
        "peak_over_warmup_pct": 100 * (max(after) / after[0] - 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=600)
    parser.add_argument("--concurrency", type=int, default=12)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--max-loras", type=int, default=2)
    parser.add_argument("--max-cpu-loras", type=int, default=3)
    parser.add_argument("--warmup", type=float, default=None, help="seconds before RSS counts (default: 20%%)")
    parser.add_argument("--port", type=int, default=8391)
    parser.add_argument("--log", default="/tmp/loraserve-soak.log")
    parser.add_argument("--mix", default="0.7,0.15,0.15", help="shares of valid, disconnecting and bad requests")
    parser.add_argument("--no-churn", action="store_true", help="no adapter load/unload worker")
    parser.add_argument("--no-hostile", action="store_true",
                        help="no hostile-adapter loads (regex bomb, 100k-deep config, overflowing alpha)")
    args = parser.parse_args()

    from loraserve.demo.run import demo_setup

    setup = demo_setup()
    url = f"http://127.0.0.1:{args.port}"
    process = start_soak_server(args.port, args)
    try:
        wait_healthy(url, process)
        mix = tuple(float(share) for share in args.mix.split(","))
        assert len(mix) == 3, "--mix needs three shares"
        hostile = None if args.no_hostile else write_hostile_adapters(setup.adapters["sql"], tempfile.mkdtemp())
        plan = SoakPlan(url, setup.served_model_name, list(setup.adapters), args.duration, args.concurrency,
                        churn_adapter_path=None if args.no_churn else setup.adapters["sql"], mix=mix,  # type: ignore[arg-type]
                        hostile_adapters=hostile, watch_health=True)
        started = time.monotonic()
        tally, samples = asyncio.run(soak(plan, process.pid))
        elapsed = time.monotonic() - started
    finally:
        exit_status = stop_server(process)
    warmup = args.warmup if args.warmup is not None else 0.2 * args.duration
    result = {
        "cpu": platform.processor() or platform.machine(),
        "dtype": args.dtype,
        "duration_s": round(elapsed, 1),
        "concurrency": args.concurrency,
        "exit_status": exit_status,
        **tally.summary(),
        "accounted": tally.num_accounted == tally.num_issued,
        "rss": rss_report(samples, warmup),
        "rss_samples_mib": [(round(t), round(rss / (1 << 20), 1)) for t, rss in samples[:: max(1, len(samples) // 60)]],
    }
    for key in ("issued", "outcomes", "num_lost", "num_unexpected", "accounted", "exit_status", "rss",
                "health_p99_ms", "health_max_ms"):
        print(f"{key}: {result[key]}")
    for line in tally.lost[:10] + tally.unexpected[:10]:
        print("  ", line)
    save_results(f"soak-{args.dtype}", result)


if __name__ == "__main__":
    main()
