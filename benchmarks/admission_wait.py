"""Admission wait of short requests while one client loops queue-filling requests (issue 22, item 2).

A live `loraserve serve` (the SmolLM-135M-shaped random model). Client A runs `--big-loops` loops,
each sending one request of as many sequences as one request may queue (prompts x n, ignore_eos)
after another, retrying a 503 after its Retry-After; client B sends a short streamed request every
`--every` seconds. Admission happens before a request's first token, so B's time to first token
bounds its admission wait from above; the run prints its p50/p99, B's 503s and A's completed
requests. Three servers, one after another:
- `before`: `--max-queued-share 1 --queue-wait-timeout 0`, the admission this project had (one
  request may take the whole queue; a full queue is a 503 at once),
- `no-keys`: the defaults (one request holds at most half the queue; a full queue waits up to 5 s),
- `keys`: the defaults with two API keys, A's and B's (one key holds at most half the queue).
Usage: python -m benchmarks.admission_wait [--duration 30] [--queue 256] [--modes before,no-keys,keys]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.common import build_model, limit_threads, save_results
from benchmarks.server_process import running_server

KEY_A, KEY_B = "looping-client-key", "short-client-key"
MODES: dict[str, tuple[list[str], bool]] = {  # server flags, whether the clients send API keys
    "before": (["--max-queued-share", "1", "--queue-wait-timeout", "0"], False),
    "no-keys": ([], False),
    "keys": (["--api-key", KEY_A, KEY_B], True),
}


@dataclass(slots=True)
class Counts:
    short_ttft_s: list[float] = field(default_factory=list)
    short_503: int = 0
    short_other: int = 0
    big_done: int = 0
    big_503: int = 0


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))] if ordered else float("nan")


async def _big_loop(http: httpx.AsyncClient, body: dict[str, Any], until: float, counts: Counts) -> None:
    while time.monotonic() < until:
        response = await http.post("/v1/completions", json=body)
        if response.status_code == 503:
            counts.big_503 += 1
            await asyncio.sleep(float(response.headers.get("retry-after", "1")))
        else:
            response.raise_for_status()
            counts.big_done += 1


async def _short(http: httpx.AsyncClient, model: str, counts: Counts) -> None:
    body = {"model": model, "prompt": [9, 10, 11, 12], "max_tokens": 2, "ignore_eos": True, "stream": True}
    start = time.monotonic()
    async with http.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code == 503:
            counts.short_503 += 1
            return
        if response.status_code != 200:
            counts.short_other += 1
            return
        first: float | None = None
        async for line in response.aiter_lines():  # read to the end: the request finishes normally
            if first is None and line.startswith("data: "):
                first = time.monotonic() - start
        if first is not None:
            counts.short_ttft_s.append(first)


async def _drive(url: str, model: str, args: argparse.Namespace, share: float, keys: bool) -> Counts:
    counts = Counts()
    big_seqs = max(1, int(args.queue * share))
    n = max(1, big_seqs // args.big_prompts)
    big = {"model": model, "prompt": [[5, 6, 7]] * args.big_prompts, "n": n, "max_tokens": args.big_tokens,
           "ignore_eos": True}
    headers_a = {"Authorization": f"Bearer {KEY_A}"} if keys else {}
    headers_b = {"Authorization": f"Bearer {KEY_B}"} if keys else {}
    timeout = httpx.Timeout(600)
    async with httpx.AsyncClient(base_url=url, headers=headers_a, timeout=timeout) as http_a, \
            httpx.AsyncClient(base_url=url, headers=headers_b, timeout=timeout) as http_b:
        until = time.monotonic() + args.duration
        loops = [asyncio.create_task(_big_loop(http_a, big, until, counts)) for _ in range(args.big_loops)]
        await asyncio.sleep(args.every)  # A's first requests are in
        shorts = []
        while time.monotonic() < until:
            shorts.append(asyncio.create_task(_short(http_b, model, counts)))
            await asyncio.sleep(args.every)
        await asyncio.gather(*shorts, *loops)
    return counts


def run_mode(mode: str, model: str, args: argparse.Namespace) -> dict[str, Any]:
    flags, keys = MODES[mode]
    share = 1.0 if mode == "before" else 0.5
    server = [model, "--dtype", args.dtype, "--max-num-queued-reqs", str(args.queue), *flags]
    log_path = os.path.join(tempfile.gettempdir(), f"loraserve-admission-{mode}.log")
    with running_server(server, log_path) as url:
        warm = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2}
        headers = {"Authorization": f"Bearer {KEY_A}"} if keys else {}
        httpx.post(url + "/v1/completions", json=warm, headers=headers, timeout=600).raise_for_status()
        counts = asyncio.run(_drive(url, model, args, share, keys))
    ttft = counts.short_ttft_s
    return {
        "mode": mode,
        "short_sent": len(ttft) + counts.short_503 + counts.short_other,
        "short_admitted": len(ttft),
        "short_503": counts.short_503,
        "short_ttft_p50_s": _percentile(ttft, 0.5),
        "short_ttft_p99_s": _percentile(ttft, 0.99),
        "big_done": counts.big_done,
        "big_503": counts.big_503,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=30.0, help="seconds of load per server")
    parser.add_argument("--queue", type=int, default=256, help="the servers' --max-num-queued-reqs")
    parser.add_argument("--big-prompts", type=int, default=8, help="prompts of one big request (n fills it)")
    parser.add_argument("--big-tokens", type=int, default=32)
    parser.add_argument("--big-loops", type=int, default=2, help="client A's concurrent loops")
    parser.add_argument("--every", type=float, default=0.25, help="seconds between client B's short requests")
    parser.add_argument("--modes", default="before,no-keys,keys")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="compute threads (1 on shared cores)")
    args = parser.parse_args()
    limit_threads(args.threads)
    model = build_model()
    rows = [run_mode(mode, model, args) for mode in args.modes.split(",")]
    print(f"{'mode':8} {'short sent':>10} {'admitted':>8} {'503':>5} {'TTFT p50 s':>10} {'TTFT p99 s':>10} "
          f"{'big done':>8} {'big 503':>7}")
    for r in rows:
        print(f"{r['mode']:8} {r['short_sent']:>10} {r['short_admitted']:>8} {r['short_503']:>5} "
              f"{r['short_ttft_p50_s']:>10.3f} {r['short_ttft_p99_s']:>10.3f} {r['big_done']:>8} {r['big_503']:>7}")
    save_results("admission_wait", {"args": vars(args), "rows": rows})


if __name__ == "__main__":
    main()
