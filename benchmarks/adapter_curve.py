"""Throughput against the number of distinct adapters in the workload: loraserve beside PEFT.

loraserve: `num_requests` requests (or N, when N is larger) run 32 at a time with 16 LoRA slots, the
requests cycling over N adapters (all in host memory beforehand, as PEFT holds them all); N above 16
makes the engine swap adapters through its slots. PEFT: one `generate(adapter_names=...)` over the
same batch with N adapters loaded, for the smaller N only (it is slow: a short `peft_gen_len`).
SmolLM-135M-shaped random Llama, rank-16 adapters on all 7 projections (benchmarks.common).
Usage: python -m benchmarks.adapter_curve [--counts 1,4,16,64] [--peft-counts 1,4,16] [--dtype auto]
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.common import (
    build_adapters,
    build_model,
    cpu_class,
    limit_threads,
    random_prompts,
    save_results,
)
from benchmarks.lora_throughput import generate_tok_per_s, run_peft_mixed
from loraserve import LLM, LoRARequest
from loraserve.config import resolve_device, resolve_dtype

VOCAB_SIZE = 49152


def loraserve_curve(path: str, dtype: torch.dtype, counts: tuple[int, ...], num_requests: int = 32,
                    prompt_len: int = 32, gen_len: int = 32) -> dict[int, float]:
    """{N: generated tok/s} for requests cycling over N adapters, `num_requests` running at once."""
    adapters = build_adapters(path, max(counts))
    dtype_name = str(dtype).replace("torch.", "")
    llm = LLM(path, dtype=dtype_name, max_num_seqs=num_requests, enable_lora=True, max_loras=16,
              max_lora_rank=16, max_cpu_loras=max(16, *counts))
    requests = [LoRARequest(f"curve-{i}", i + 1, adapter) for i, adapter in enumerate(adapters[: max(counts)])]
    for request in requests:
        llm.add_lora(request)
    curve = {}
    for count in counts:
        total = max(num_requests, count)
        prompts = random_prompts(total, prompt_len, VOCAB_SIZE, seed=count)  # fresh: no prefix-cache hit
        curve[count] = generate_tok_per_s(llm, prompts, gen_len, [requests[i % count] for i in range(total)])
        print(f"  loraserve {count} adapters: {curve[count]:.1f} tok/s", flush=True)
    return curve


def peft_curve(path: str, dtype: torch.dtype, counts: tuple[int, ...], num_requests: int = 32,
               prompt_len: int = 32, gen_len: int = 16) -> dict[int, float]:
    """{N: generated tok/s} of PEFT's mixed-adapter `generate` with N adapters over the batch."""
    adapters = build_adapters(path, max(counts))
    prompts = random_prompts(num_requests, prompt_len, VOCAB_SIZE, seed=0)
    curve = {}
    for count in counts:
        curve[count] = run_peft_mixed(path, adapters[:count], prompts, gen_len, dtype)
        print(f"  PEFT {count} adapters: {curve[count]:.1f} tok/s", flush=True)
    return curve


def adapter_curve(path: str, dtype: torch.dtype, counts: tuple[int, ...] = (1, 4, 16, 64),
                  peft_counts: tuple[int, ...] = (1, 4, 16), num_requests: int = 32, prompt_len: int = 32,
                  gen_len: int = 32, peft_gen_len: int = 16) -> dict[str, dict[int, float]]:
    """{"loraserve": {N: tok/s}, "peft": {N: tok/s}}: the input of benchmarks.plot's panel (a)."""
    ours = loraserve_curve(path, dtype, counts, num_requests, prompt_len, gen_len)
    theirs = peft_curve(path, dtype, peft_counts, num_requests, prompt_len, peft_gen_len) if peft_counts else {}
    return {"loraserve": ours, "peft": theirs}


def print_adapter_curve(curve: dict[str, dict[int, float]]) -> None:
    print(f"\n{'adapters':>9}{'loraserve tok/s':>17}{'PEFT tok/s':>12}{'speed-up':>10}")
    for count in sorted(set(curve["loraserve"]) | set(curve["peft"])):
        ours, theirs = curve["loraserve"].get(count), curve["peft"].get(count)
        ratio = f"{ours / theirs:>9.1f}x" if ours and theirs else f"{'-':>10}"
        print(f"{count:>9}{ours or float('nan'):>17.1f}{theirs or float('nan'):>12.1f}{ratio}")


def _counts(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(",") if x)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--counts", default="1,4,16,64", help="loraserve: distinct adapter counts")
    parser.add_argument("--peft-counts", default="1,4,16", help="PEFT: distinct adapter counts ('' to skip)")
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--peft-gen-len", type=int, default=16)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None, help="compute threads (1 on cores shared with other jobs)")
    args = parser.parse_args()
    limit_threads(args.threads)
    dtype = resolve_dtype(args.dtype, resolve_device("cpu"))
    dtype_name = str(dtype).replace("torch.", "")
    print(f"{cpu_class()}, {dtype_name}, {args.num_requests} requests at once x ({args.prompt_len} prompt + "
          f"{args.gen_len} generated; PEFT {args.peft_gen_len}), rank-16 adapters on all 7 projections")
    curve = adapter_curve(build_model(), dtype, _counts(args.counts), _counts(args.peft_counts),
                          args.num_requests, args.prompt_len, args.gen_len, args.peft_gen_len)
    print_adapter_curve(curve)
    save_results("adapter_curve", {"cpu": cpu_class(), "dtype": dtype_name, "args": vars(args),
                                   "adapters": {k: {str(n): v for n, v in c.items()} for k, c in curve.items()}})


if __name__ == "__main__":
    main()
