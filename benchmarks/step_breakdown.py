"""One decode step of a random model of a real shape, taken apart: loraserve's and transformers' step
time against the time of the model's linears alone and against the weight-read bound.

Times are CPU seconds of this process (one thread by default), the work on a shared machine.
- step: (time of generating 1 + N tokens - time of generating 1) / N, so prefill falls out; for
  loraserve and for transformers `generate` on the same prompts (batch B, equal lengths).
- linears: the model's linears (attention and MLP per layer, plus the LM head) alone at B rows, with
  loraserve's packed weights and kernels: what a step cannot go below without other kernels.
- bound: the bytes of the weights a decode step reads (every layer's linears and the LM head; for an
  MoE only the experts the step's tokens could route to are counted as all of them, the upper bound)
  over the read bandwidth measured in the same run (a sum over a buffer larger than the caches).
Usage: python -m benchmarks.step_breakdown --shape gemma3-1b --batch 1 16 [--num-layers N] [--steps 6]
"""

from __future__ import annotations

import argparse
import platform
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks.common import GEMMA_SHAPES, MOE_SHAPES, build_gemma_model, build_moe_model, random_prompts
from loraserve import LLM, SamplingParams


def best_of(fn: Callable[[], Any], repeats: int) -> float:
    """The fastest of `repeats` runs, in this process's CPU seconds: at one thread on a machine shared
    with other jobs, CPU time is the work itself, where wall time is mostly the others' turns."""
    best = float("inf")
    for _ in range(repeats):
        start = time.process_time()
        fn()
        best = min(best, time.process_time() - start)
    return best


def read_bandwidth(megabytes: int = 1024, repeats: int = 3) -> float:
    """Bytes per second of one thread's streaming read (a bf16 sum over a buffer past every cache)."""
    buf = torch.ones(megabytes * 2**19, dtype=torch.bfloat16)
    buf.sum()
    return buf.numel() * 2 / best_of(lambda: buf.sum(), repeats)


def linear_shapes(cfg: Any) -> tuple[list[tuple[int, int]], int]:
    """(in, out) of one layer's dense linears (experts as one expert's gate_up/down times the routed
    count), and the LM head's out features."""
    hidden = cfg.hidden_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q = cfg.num_attention_heads * head_dim
    kv = cfg.num_key_value_heads * head_dim
    shapes = [(hidden, q + 2 * kv), (q, hidden)]
    if getattr(cfg, "num_experts", None):
        shapes += [(hidden, cfg.num_experts)]
        shapes += [(hidden, 2 * cfg.intermediate_size), (cfg.intermediate_size, hidden)] * cfg.num_experts
    else:
        shapes += [(hidden, 2 * cfg.intermediate_size), (cfg.intermediate_size, hidden)]
    return shapes, cfg.vocab_size


def linears_run(cfg: Any, rows: int, dtype: torch.dtype) -> tuple[Callable[[], None], int]:
    """A step of only the model's linears at `rows` rows (distinct weights per layer), and their bytes."""
    from loraserve.layers.linear import Linear, pack_cpu_linears

    shapes, vocab = linear_shapes(cfg)
    layers = [[Linear(i, o, dtype=dtype) for i, o in shapes] for _ in range(cfg.num_hidden_layers)]
    head = Linear(cfg.hidden_size, vocab, dtype=dtype)
    every = [lin for group in layers for lin in group] + [head]
    for lin in every:
        lin.weight.data.normal_()
    pack_cpu_linears(torch.nn.ModuleList(every))
    inputs = {i: torch.randn(rows, i, dtype=dtype) for i, _ in shapes}
    head_in = torch.randn(rows, cfg.hidden_size, dtype=dtype)
    nbytes = (
        sum(i * o for i, o in shapes) * cfg.num_hidden_layers + cfg.hidden_size * vocab
    ) * dtype.itemsize

    def run() -> None:
        with torch.inference_mode():
            for group in layers:
                for (i, _), lin in zip(shapes, group):
                    lin.base_forward(inputs[i])
            head.base_forward(head_in)

    return run, nbytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="gemma3-1b", choices=[*GEMMA_SHAPES, *MOE_SHAPES])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--steps", type=int, default=6, help="decode steps timed per run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    from transformers import AutoConfig, AutoModelForCausalLM

    path = (
        build_moe_model(args.shape)
        if args.shape in MOE_SHAPES
        else build_gemma_model(args.shape, args.num_layers)
    )
    cfg = AutoConfig.from_pretrained(path)
    cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
    dtype = torch.bfloat16
    vocab = cfg.vocab_size
    bandwidth = read_bandwidth()
    print(
        f"{platform.processor() or platform.machine()}, torch threads={torch.get_num_threads()}, bf16, {args.shape}"
        f"{'' if args.num_layers is None else f' ({args.num_layers} layers)'}; read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    max_len = args.prompt_len + args.steps + 8
    llm = LLM(path, dtype="bfloat16", max_num_seqs=max(args.batch), max_model_len=max(max_len, 256))
    hf = None if args.skip_transformers else AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    print(f"{'batch':>5} {'ours ms':>9} {'hf ms':>9} {'linears ms':>11} {'bound ms':>9} {'weights GB':>11}")
    for batch in args.batch:
        prompts = random_prompts(batch, args.prompt_len, vocab)

        def ours(n: int, prompts: list[list[int]] = prompts) -> None:
            params = SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
            llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

        def theirs(n: int, prompts: list[list[int]] = prompts) -> None:
            assert hf is not None
            with torch.inference_mode():
                hf.generate(
                    torch.tensor(prompts), max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0
                )

        steps = args.steps
        ours(2)
        ours_ms = (
            best_of(lambda: ours(1 + args.steps), args.repeats) - best_of(lambda: ours(1), args.repeats)
        ) / steps
        hf_ms = float("nan")
        if hf is not None:
            theirs(2)
            hf_ms = (
                best_of(lambda: theirs(1 + args.steps), args.repeats)
                - best_of(lambda: theirs(1), args.repeats)
            ) / steps
        run, nbytes = linears_run(cfg, batch, dtype)
        run()
        lin_ms = best_of(run, args.repeats)
        del run
        print(
            f"{batch:>5} {ours_ms * 1e3:>9.1f} {hf_ms * 1e3:>9.1f} {lin_ms * 1e3:>11.1f} "
            f"{nbytes / bandwidth * 1e3:>9.1f} {nbytes / 1e9:>11.2f}",
            flush=True,
        )


if __name__ == "__main__":
    main()
