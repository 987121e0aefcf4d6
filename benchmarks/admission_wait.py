"""Admission wait of short requests while one client loops queue-filling requests (issue 22, item 2).

A live `loraserve serve` (the SmolLM-135M-shaped random model). Client A runs `--big-loops` loops,
each sending one request of as many sequences as one request may queue (prompts x n, ignore_eos)
after another, retrying a 503 after its Retry-After; client B sends a short streamed request every
`--every` seconds. Admission happens before a request's first token, so B's time to first token
bounds its admission wait from above (the batch has seats beyond A's share, so B's requests do not
wait for seats); the server's own histogram `loraserve:admission_wait_seconds` (every admitted call,
A's and B's) gives the share admitted within 1 s and 2.5 s and its p99 to a bucket. The run prints
those, B's 503s and A's completed requests. Three servers, one after another:
- `before`: `--max-queued-share 1 --queue-wait-timeout 0`, the admission this project had (one
  request may take the whole queue; a full queue is a 503 at once),
- `no-keys`: the defaults (one request holds at most half the queue; a full queue waits up to 5 s),
- `keys`: the defaults with two API keys, A's and B's (one key holds at most half the queue).
Usage: python -m benchmarks.admission_wait [--duration 30] [--queue 256] [--modes before,no-keys,keys]
(`benchmarks.all --with-admission` adds these rows to the combined run; they are not in its default.)
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from dataclasses import asdict, dataclass, field
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


@dataclass(frozen=True, slots=True)
class AdmissionShape:
    duration: float = 30.0  # seconds of load per server
    queue: int = 128  # the servers' --max-num-queued-reqs (their --max-num-seqs stays 128)
    big_prompts: int = 4  # prompts of one big request (n fills its share)
    big_tokens: int = 32
    big_loops: int = 2  # client A's concurrent loops
    every: float = 0.25  # seconds between client B's short requests


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


async def _drive(url: str, model: str, args: AdmissionShape, share: float, keys: bool) -> Counts:
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


def run_mode(mode: str, model: str, dtype: str, args: AdmissionShape) -> dict[str, Any]:
    """One server in `mode` under the two clients; B's counts and TTFT percentiles, A's counts."""
    flags, keys = MODES[mode]
    share = 1.0 if mode == "before" else 0.5
    server = [model, "--dtype", dtype, "--max-num-queued-reqs", str(args.queue), *flags]
    log_path = os.path.join(tempfile.gettempdir(), f"loraserve-admission-{mode}.log")
    with running_server(server, log_path) as url:
        warm = {"model": model, "prompt": [5, 6, 7], "max_tokens": 2}
        headers = {"Authorization": f"Bearer {KEY_A}"} if keys else {}
        httpx.post(url + "/v1/completions", json=warm, headers=headers, timeout=600).raise_for_status()
        counts = asyncio.run(_drive(url, model, args, share, keys))
        waits = _admission_histogram(httpx.get(url + "/metrics", headers=headers, timeout=60).text)
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
        **waits,
    }


def _admission_histogram(text: str) -> dict[str, Any]:
    """From /metrics: how many calls were admitted, the share within 1 s and 2.5 s, the p99 bucket."""
    from prometheus_client.parser import text_string_to_metric_families

    buckets: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "loraserve:admission_wait_seconds":
            for sample in family.samples:
                if sample.name.endswith("_bucket"):
                    buckets[float(sample.labels["le"])] = sample.value
    total = buckets.get(float("inf"), 0.0)
    if not total:
        return {"admitted_calls": 0}
    p99 = min(le for le, count in buckets.items() if count >= 0.99 * total)
    return {
        "admitted_calls": int(total),
        "admitted_within_1s": buckets.get(1.0, 0.0) / total,
        "admitted_within_2_5s": buckets.get(2.5, 0.0) / total,
        "admission_wait_p99_at_most_s": p99,
    }


def run_admission_wait(model: str, dtype: str, shape: AdmissionShape, modes: list[str]) -> dict[str, Any]:
    return {"shape": asdict(shape), "rows": [run_mode(mode, model, dtype, shape) for mode in modes]}


def print_admission_wait(result: dict[str, Any]) -> None:
    print(f"{'mode':8} {'short sent':>10} {'admitted':>8} {'503':>5} {'TTFT p50 s':>10} {'TTFT p99 s':>10} "
          f"{'big done':>8} {'big 503':>7} {'server: calls':>13} {'<=1s':>6} {'<=2.5s':>6} {'p99<=s':>6}")
    for r in result["rows"]:
        print(f"{r['mode']:8} {r['short_sent']:>10} {r['short_admitted']:>8} {r['short_503']:>5} "
              f"{r['short_ttft_p50_s']:>10.3f} {r['short_ttft_p99_s']:>10.3f} {r['big_done']:>8} {r['big_503']:>7} "
              f"{r['admitted_calls']:>13} {r.get('admitted_within_1s', float('nan')):>6.3f} "
              f"{r.get('admitted_within_2_5s', float('nan')):>6.3f} "
              f"{r.get('admission_wait_p99_at_most_s', float('nan')):>6}")


def main() -> None:
    defaults = AdmissionShape()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--duration", type=float, default=defaults.duration, help="seconds of load per server")
    parser.add_argument("--queue", type=int, default=defaults.queue, help="the servers' --max-num-queued-reqs")
    parser.add_argument("--big-prompts", type=int, default=defaults.big_prompts,
                        help="prompts of one big request (n fills its share)")
    parser.add_argument("--big-tokens", type=int, default=defaults.big_tokens)
    parser.add_argument("--big-loops", type=int, default=defaults.big_loops, help="client A's concurrent loops")
    parser.add_argument("--every", type=float, default=defaults.every,
                        help="seconds between client B's short requests")
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="compute threads (1 on shared cores)")
    args = parser.parse_args()
    limit_threads(args.threads)
    shape = AdmissionShape(args.duration, args.queue, args.big_prompts, args.big_tokens, args.big_loops, args.every)
    result = run_admission_wait(build_model(), args.dtype, shape, args.modes.split(","))
    print_admission_wait(result)
    save_results("admission_wait", {"dtype": args.dtype, "threads": args.threads, **result})


if __name__ == "__main__":
    main()
