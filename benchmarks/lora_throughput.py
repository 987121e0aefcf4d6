"""Multi-LoRA throughput and cold-load latency: loraserve vs transformers and PEFT, in one run.

SmolLM-135M-shaped random Llama; rank-16 adapters on all 7 projections; 32 greedy requests.
Rows: transformers base, PEFT mixed batch (`generate(adapter_names=...)`), loraserve base,
loraserve 1 adapter, loraserve N mixed; then N-adapter swapping with max_loras=16 and the first-request
latency of a cold (on disk) adapter against a warm one.
Usage: python -m benchmarks.lora_throughput [--prompt-len 32] [--gen-len 32] [--swap-adapters 64,256]
"""

from __future__ import annotations

import argparse
import statistics
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import (
    build_adapters,
    build_model,
    interleaved_timed,
    print_table,
    random_prompts,
    save_results,
    steady_timed,
    timed,
)
from benchmarks.throughput import run_transformers
from loraserve import LLM, LoRARequest, SamplingParams
from loraserve.config import resolve_device, resolve_dtype


def run_peft_mixed(path: str, adapters: list[str], prompts: list[list[int]], gen_len: int,
                   dtype: torch.dtype) -> float:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    model = PeftModel.from_pretrained(base, adapters[0], adapter_name="a0")
    for i, adapter in enumerate(adapters[1:], start=1):
        model.load_adapter(adapter, adapter_name=f"a{i}")
    names = [f"a{i % len(adapters)}" for i in range(len(prompts))]
    kwargs = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        seconds, _ = steady_timed(
            lambda ids: model.generate(input_ids=torch.tensor(ids), adapter_names=names, **kwargs), prompts
        )
    return len(prompts) * gen_len / seconds


def generate_run(llm: LLM, gen_len: int, loras: list[LoRARequest | None]) -> Callable[[list[list[int]]], Any]:
    """One greedy `generate` call of fixed-length outputs over the given prompts, checked."""
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)

    def run(ids: list[list[int]]) -> Any:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, lora_request=loras, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == gen_len for o in outs)
        return outs
    return run


def generate_tok_per_s(llm: LLM, prompts: list[list[int]], gen_len: int,
                       loras: list[LoRARequest | None]) -> float:
    """Generated tokens per second of one `generate` call over all `prompts` (greedy, fixed length),
    in steady state (`steady_timed`: one untimed call first, adapters loaded and pages touched, then the
    best of three timed calls, each on prompts of its own)."""
    seconds, _ = steady_timed(generate_run(llm, gen_len, loras), prompts)
    return len(prompts) * gen_len / seconds


def run_loraserve(path: str, adapters: list[str], prompts: list[list[int]], gen_len: int, dtype: str,
                  num_mixed: int) -> dict[str, float]:
    """The base, one adapter and `num_mixed` mixed, timed in turn (`interleaved_timed`): their ratios
    are the figures."""
    n = len(prompts)
    base = LLM(path, dtype=dtype, max_num_seqs=n)
    llm = LLM(path, dtype=dtype, max_num_seqs=n, enable_lora=True, max_loras=16, max_lora_rank=16,
              max_cpu_loras=max(16, num_mixed))
    reqs = [LoRARequest(f"a{i}", i + 1, p) for i, p in enumerate(adapters[:num_mixed])]
    runs = {
        "loraserve base": generate_run(base, gen_len, [None] * n),
        "loraserve 1 adapter": generate_run(llm, gen_len, [reqs[0]] * n),
        f"loraserve {num_mixed} mixed": generate_run(llm, gen_len, [reqs[i % num_mixed] for i in range(n)]),
    }
    return {name: n * gen_len / seconds for name, (seconds, _) in interleaved_timed(runs, prompts).items()}


def run_swapping(path: str, adapters: list[str], prompts: list[list[int]], gen_len: int, dtype: str) -> float:
    """Every request on a different adapter (cycling through all of them), 16 compute slots."""
    llm = LLM(path, dtype=dtype, max_num_seqs=len(prompts), enable_lora=True, max_loras=16,
              max_lora_rank=16, max_cpu_loras=len(adapters))
    reqs = [LoRARequest(f"s{i}", i + 1, p) for i, p in enumerate(adapters)]
    for r in reqs:
        llm.add_lora(r)
    total_prompts = [prompts[i % len(prompts)] for i in range(len(adapters))]
    return generate_tok_per_s(llm, total_prompts, gen_len, reqs)


def first_token_latency(path: str, adapters: list[str], dtype: str, repeats: int = 5) -> tuple[float, float]:
    """Median seconds to the first token for a cold adapter (loaded from disk) and a warm one."""
    llm = LLM(path, dtype=dtype, enable_lora=True, max_loras=4, max_lora_rank=16, max_cpu_loras=len(adapters))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    # A fresh prompt for every measurement, so no prefix-cache hit flatters the warm case.
    prompts = [{"prompt_token_ids": p} for p in random_prompts(2 * repeats + 1, 32, 49152, seed=7)]
    llm.generate(prompts[-1], params, use_tqdm=False)  # warm-up of the forward pass itself
    def seconds(prompt: dict, req: LoRARequest) -> float:
        return timed(lambda: llm.generate(prompt, params, lora_request=req, use_tqdm=False))[0]

    cold, warm = [], []
    for i in range(repeats):
        req = LoRARequest(f"c{i}", i + 1, adapters[i])
        cold.append(seconds(prompts[2 * i], req))
        warm.append(seconds(prompts[2 * i + 1], req))
    return statistics.median(cold), statistics.median(warm)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--num-mixed", type=int, default=16)
    parser.add_argument("--swap-adapters", default="64,256", help="comma-separated adapter counts ('' to skip)")
    parser.add_argument("--skip-baselines", action="store_true")
    parser.add_argument("--dtype", default="auto")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, resolve_device("cpu"))
    dtype_name = str(dtype).replace("torch.", "")
    swaps = [int(x) for x in args.swap_adapters.split(",") if x]
    path = build_model()
    adapters = build_adapters(path, max([args.num_mixed, 5, *swaps]))
    prompts = random_prompts(args.num_requests, args.prompt_len, 49152)
    print(f"{dtype_name}, {args.num_requests} requests x ({args.prompt_len} prompt + {args.gen_len} generated), "
          f"rank-16 adapters on all 7 projections")
    rows: list[tuple[str, float]] = []

    def record(name: str, tok_per_s: float) -> None:
        rows.append((name, tok_per_s))
        print(f"  {name}: {tok_per_s:.1f} tok/s", flush=True)

    if not args.skip_baselines:
        record("transformers base", run_transformers(path, prompts, args.gen_len, dtype))
        record(f"PEFT {args.num_mixed} mixed",
               run_peft_mixed(path, adapters[: args.num_mixed], prompts, args.gen_len, dtype))
    for name, tps in run_loraserve(path, adapters, prompts, args.gen_len, dtype_name, args.num_mixed).items():
        record(name, tps)
    for count in swaps:
        record(f"loraserve {count} distinct (max_loras=16)",
               run_swapping(path, adapters[:count], prompts, args.gen_len, dtype_name))
    reference = "PEFT 16 mixed" if not args.skip_baselines and args.num_mixed == 16 else "loraserve base"
    print_table("Multi-LoRA throughput", rows, reference)
    table = dict(rows)
    print(f"\n{args.num_mixed}-mixed / loraserve base: "
          f"{table[f'loraserve {args.num_mixed} mixed'] / table['loraserve base']:.2f}")
    cold, warm = first_token_latency(path, adapters[:5], dtype_name)
    print(f"first-token latency: cold adapter {cold * 1000:.1f} ms, warm {warm * 1000:.1f} ms, "
          f"difference {(cold - warm) * 1000:.1f} ms")
    save_results("lora_throughput", {"dtype": dtype_name, "args": vars(args), "tok_per_s": table,
                                     "cold_ms": cold * 1000, "warm_ms": warm * 1000})


if __name__ == "__main__":
    main()
