"""The native families side by side in one run: loraserve vs transformers `generate` on random models
of their small real shapes (Gemma-3-1B, Gemma-2-2B, Phi-3.5-mini, OLMoE-1B-7B layers), each pair timed
in turn, with the decode step's weight-read bound beside them.

The bound column is the generated tok/s a decode step could not beat on this machine: requests x read
bandwidth (measured in the same run) / the bytes a decode step must read: every dense weight and the
LM head; for an MoE only the experts its tokens are expected to hit (E (1 - (1 - 1/E)^(B k)) of E at
batch B and top-k). Where transformers already runs near that bound, no engine reaches 3x of it.
Usage: python -m benchmarks.families [--shapes gemma3-1b phi3.5-mini olmoe-2l] [--num-layers N ...]
       [--num-requests 16] [--prompt-len 32] [--gen-len 32] [--repeats 1]
"""

from __future__ import annotations

import argparse
import gc
import platform
from typing import Any

import torch

from benchmarks.common import (
    GEMMA_SHAPES,
    MOE_SHAPES,
    build_gemma_model,
    build_moe_model,
    interleaved_timed,
    random_prompts,
    save_results,
)
from benchmarks.step_breakdown import linear_shapes, read_bandwidth
from benchmarks.throughput import loraserve_run

DEFAULT_LAYERS = {"phi3.5-mini": 8, "gemma2-2b": 13}  # fits a 23 GB machine beside transformers' copy


def decode_bytes(cfg: Any, batch: int) -> int:
    """Bytes of weights one decode step of `batch` sequences reads (bf16), experts by expected hits."""
    shapes, vocab = linear_shapes(cfg)
    experts = getattr(cfg, "num_experts", None)
    per_layer = sum(i * o for i, o in shapes)
    if experts:
        one = 3 * cfg.hidden_size * cfg.intermediate_size
        hit = experts * (1.0 - (1.0 - 1.0 / experts) ** (batch * cfg.num_experts_per_tok))
        per_layer -= int((experts - hit) * one)
    return 2 * (per_layer * cfg.num_hidden_layers + cfg.hidden_size * vocab)


def hf_run(path: str, gen_len: int) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    kwargs = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False, pad_token_id=0)

    def run(ids: list[list[int]]) -> None:
        with torch.inference_mode():
            model.generate(torch.tensor(ids), **kwargs)

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shapes", nargs="+", default=["gemma3-1b", "phi3.5-mini", "olmoe-2l"])
    parser.add_argument(
        "--num-layers", type=int, nargs="*", default=None, help="per shape (default: all, Phi 8)"
    )
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--gen-len", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=1)
    args = parser.parse_args()
    from transformers import AutoConfig

    bandwidth = read_bandwidth()
    print(
        f"{platform.processor() or platform.machine()}, torch threads={torch.get_num_threads()}, bf16, "
        f"{args.num_requests} requests x ({args.prompt_len} + {args.gen_len}) tokens, "
        f"read bandwidth {bandwidth / 1e9:.1f} GB/s"
    )
    rows = []
    for i, shape in enumerate(args.shapes):
        layers = args.num_layers[i] if args.num_layers else DEFAULT_LAYERS.get(shape)
        path = build_moe_model(shape) if shape in MOE_SHAPES else build_gemma_model(shape, layers)
        cfg = AutoConfig.from_pretrained(path)
        cfg = cfg.get_text_config() if hasattr(cfg, "get_text_config") else cfg
        vocab = {**GEMMA_SHAPES, **MOE_SHAPES}[shape]["vocab_size"]
        prompts = random_prompts(args.num_requests, args.prompt_len, vocab)
        max_len = 4096 if shape == "phi3.5-mini" else None
        runs = {
            "transformers": hf_run(path, args.gen_len),
            "loraserve": loraserve_run(path, args.num_requests, args.gen_len, "bfloat16", max_len),
        }
        timings = interleaved_timed(runs, prompts, args.repeats)
        rate = {k: args.num_requests * args.gen_len / t[0] for k, t in timings.items()}
        bound = args.num_requests * bandwidth / decode_bytes(cfg, args.num_requests)
        name = shape if layers is None else f"{shape} ({layers} layers)"
        rows.append((name, rate["transformers"], rate["loraserve"], bound))
        print(
            f"{name:<28}{rate['transformers']:>10.1f}{rate['loraserve']:>11.1f}"
            f"{rate['loraserve'] / rate['transformers']:>8.2f}x{bound:>16.1f}",
            flush=True,
        )
        del runs, timings
        gc.collect()
    print(f"\n{'shape':<28}{'hf tok/s':>10}{'ours tok/s':>11}{'ratio':>9}{'decode bound':>16}")
    for name, hf, ours, bound in rows:
        print(f"{name:<28}{hf:>10.1f}{ours:>11.1f}{ours / hf:>8.2f}x{bound:>16.1f}")
    save_results(
        "families",
        {
            "args": vars(args),
            "bandwidth_gb_s": bandwidth / 1e9,
            "rows": [dict(shape=r[0], hf=r[1], ours=r[2], decode_bound=r[3]) for r in rows],
        },
    )


if __name__ == "__main__":
    main()
