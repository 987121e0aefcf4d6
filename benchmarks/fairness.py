"""Fairness: the latency of short requests arriving beside one big request (many sequences).

The big request is one API call of `--big-prompts` prompts x n=`--big-n` (one scheduling group); a
short request (one prompt, `--short-tokens` tokens) arrives every `--every` steps. Run twice in one
process: with turn-taking (each short request its own group, as the server sends them) and with the
short requests put in the big request's group, which is what first-come-first-served admission did.
Prints p50/p99 of the short requests' time to first token and to finish, in steps and milliseconds.
Usage: python -m benchmarks.fairness [--big-prompts 16] [--big-n 16] [--max-num-seqs 32]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

from benchmarks.common import build_model, save_results
from loraserve import SamplingParams
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.llm_engine import LLMEngine


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def run(engine: LLMEngine, args: argparse.Namespace, fair: bool) -> dict[str, float]:
    rng = random.Random(0)
    big = SamplingParams(max_tokens=args.big_tokens, n=args.big_n, ignore_eos=True)
    for i in range(args.big_prompts):
        prompt = [rng.randrange(10, 500) for _ in range(args.prompt_len)]
        engine.add_request(f"big-{fair}-{i}", {"prompt_token_ids": prompt}, big, group_id=f"big-{fair}")
    short = SamplingParams(max_tokens=args.short_tokens, ignore_eos=True)
    added: dict[str, tuple[int, float]] = {}
    first: dict[str, tuple[int, float]] = {}
    done: dict[str, tuple[int, float]] = {}
    step = 0
    while engine.has_unfinished_requests() or len(added) < args.num_short:
        if step % args.every == 0 and len(added) < args.num_short:
            request_id = f"short-{fair}-{len(added)}"
            prompt = [rng.randrange(10, 500) for _ in range(args.prompt_len)]
            group = None if fair else f"big-{fair}"
            engine.add_request(request_id, {"prompt_token_ids": prompt}, short, group_id=group)
            added[request_id] = (step, time.perf_counter())
        for output in engine.step():
            if output.request_id in added:
                now = (step, time.perf_counter())
                if output.outputs and output.outputs[0].token_ids:
                    first.setdefault(output.request_id, now)
                if output.finished:
                    done[output.request_id] = now
        step += 1
    ttft_steps = [float(first[r][0] - added[r][0]) for r in added]
    ttft_ms = [1000 * (first[r][1] - added[r][1]) for r in added]
    e2e_ms = [1000 * (done[r][1] - added[r][1]) for r in added]
    return {
        "ttft_steps_p50": statistics.median(ttft_steps), "ttft_steps_p99": _percentile(ttft_steps, 0.99),
        "ttft_ms_p50": statistics.median(ttft_ms), "ttft_ms_p99": _percentile(ttft_ms, 0.99),
        "e2e_ms_p99": _percentile(e2e_ms, 0.99), "total_steps": step,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--big-prompts", type=int, default=16)
    parser.add_argument("--big-n", type=int, default=16)
    parser.add_argument("--big-tokens", type=int, default=32)
    parser.add_argument("--short-tokens", type=int, default=4)
    parser.add_argument("--num-short", type=int, default=40)
    parser.add_argument("--every", type=int, default=4)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--max-num-seqs", type=int, default=32)
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    engine = LLMEngine.from_engine_args(
        EngineArgs(model=build_model(), dtype=args.dtype, max_num_seqs=args.max_num_seqs,
                   kv_cache_memory_bytes=512 << 20, max_num_queued_reqs=1 << 20)
    )
    results = {"turns (loraserve)": run(engine, args, fair=True), "FCFS (one group)": run(engine, args, fair=False)}
    columns = ["ttft_steps_p50", "ttft_steps_p99", "ttft_ms_p50", "ttft_ms_p99", "e2e_ms_p99", "total_steps"]
    header = f"{'scheduling':<20}" + "".join(f"{c:>16}" for c in columns)
    print(f"big request: {args.big_prompts} prompts x n={args.big_n} x {args.big_tokens} tokens; "
          f"{args.num_short} short requests of {args.short_tokens} tokens, one every {args.every} steps; "
          f"max_num_seqs={args.max_num_seqs}, dtype={engine.model_config.dtype}")
    print(header)
    for name, r in results.items():
        print(f"{name:<20}" + "".join(f"{r[c]:>16.0f}" for c in columns))
    save_results("fairness", {"args": vars(args), "results": results})


if __name__ == "__main__":
    main()
