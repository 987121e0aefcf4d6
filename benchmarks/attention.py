"""Step attention on CPU: the torch gather + SDPA path vs the C kernel, for a whole model's layers.

One step = the step's metadata (built once, as the model runner does) plus, per layer, the KV write and
attention through `PagedAttention`: a decode step of --batch sequences for each of --contexts, and a
prefill step of --prefill-seqs sequences (query = context) for each of --prefill; blocks are shuffled
over the cache. The two paths are switched with LORASERVE_CPU_ATTENTION_KERNEL and timed alternately; each
number is the best of --reps steps.
Usage: python -m benchmarks.attention [--contexts 128,1024,2048] [--prefill 512] [--dtypes bfloat16,float32]
       [--kv-cache-dtypes auto,bfloat16,fp8,int8]
The engine's 32-sequence shapes: --batch 32 --contexts 128 --prefill 64 --prefill-seqs 32
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import time
from collections.abc import Callable

import torch

from loraserve.batch.attention_metadata import build_attention_metadata
from loraserve.batch.kv_cache import KVCache, KVScales, has_block_scales
from loraserve.cache_config import KV_CACHE_DTYPES, kv_cache_torch_dtype
from loraserve.layers.attention import PagedAttention


def random_cache(shape: tuple[int, int, int], num_blocks: int, dtype: torch.dtype) -> KVCache:
    """One layer's cache of random values in `dtype` (int8: stored values and block scales of unit-size K/V)."""
    if not has_block_scales(dtype):
        return KVCache(torch.randn(shape).to(dtype), torch.randn(shape).to(dtype))
    k, v = (torch.randint(-127, 128, shape, dtype=dtype) for _ in range(2))
    scales = [torch.full((num_blocks, shape[1]), 1 / 42) for _ in range(2)]
    return KVCache(k, v, KVScales(*scales))


def make_step(
    args: argparse.Namespace,
    b: int,
    query_len: int,
    context_len: int,
    dtype: torch.dtype,
    kv_dtype: torch.dtype | None = None,
) -> Callable[[], None]:
    """A closure running one step of b sequences (query_len new tokens each) over `args.layers` layers."""
    bs = args.block_size
    per_seq = (context_len + bs - 1) // bs
    blocks = list(range(b * per_seq + 8))
    random.Random(0).shuffle(blocks)
    tables = [blocks[i * per_seq : (i + 1) * per_seq] for i in range(b)]
    shape = (len(blocks) * bs, args.kv_heads, args.head_dim)
    caches = [random_cache(shape, len(blocks), kv_dtype or dtype) for _ in range(args.layers)]
    layer = PagedAttention(args.heads, args.kv_heads, args.head_dim, args.head_dim**-0.5)
    width = (args.heads + 2 * args.kv_heads) * args.head_dim
    qkv = torch.randn(b * query_len, width).to(dtype)
    q, k, v = qkv.split(
        [args.heads * args.head_dim, args.kv_heads * args.head_dim, args.kv_heads * args.head_dim], 1
    )

    def step() -> None:
        meta = build_attention_metadata([query_len] * b, [context_len] * b, tables, bs, torch.device("cpu"))
        for kv_cache in caches:
            layer(q, k, v, kv_cache, meta)

    return step


def best_of(steps: dict[str, Callable[[], None]], reps: int) -> dict[str, float]:
    """Milliseconds per step, best of `reps`, the paths alternating so both see the same machine load."""
    best = dict.fromkeys(steps, float("inf"))
    for rep in range(reps + 1):
        for name, step in steps.items():
            os.environ["LORASERVE_CPU_ATTENTION_KERNEL"] = "1" if name == "kernel" else "0"
            start = time.perf_counter()
            with torch.inference_mode():
                step()
            if rep:  # the first round warms up (kernel build, page faults)
                best[name] = min(best[name], (time.perf_counter() - start) * 1e3)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--heads", type=int, default=9)
    parser.add_argument("--kv-heads", type=int, default=3)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--contexts", default="128,1024,2048", help="decode steps at these context lengths")
    parser.add_argument("--prefill", default="", help="prefill chunks of these lengths")
    parser.add_argument("--prefill-seqs", type=int, default=1, help="sequences per prefill step")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument(
        "--kv-cache-dtypes",
        default="auto",
        help=f"KV-cache formats (--kv-cache-dtype: {', '.join(KV_CACHE_DTYPES)})",
    )
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--reps", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(
        f"{platform.processor() or platform.machine()}, {args.threads} threads; B={args.batch} H={args.heads} "
        f"KVH={args.kv_heads} D={args.head_dim}, {args.layers} layers, block size {args.block_size}"
    )
    print(f"{'dtype':>9} {'kv':>9} {'step':>8} {'seqs':>5} {'context':>8} {'torch gather ms':>16} {'kernel ms':>10} "
          f"{'speedup':>8}")  # fmt: skip
    shapes = [("decode", args.batch, 1, int(c)) for c in args.contexts.split(",") if c]
    shapes += [("prefill", args.prefill_seqs, int(n), int(n)) for n in args.prefill.split(",") if n]
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        for kv_name in args.kv_cache_dtypes.split(","):
            kv_dtype = kv_cache_torch_dtype(kv_name, dtype)
            for kind, b, query_len, context_len in shapes:
                step = make_step(args, b, query_len, context_len, dtype, kv_dtype)
                best = best_of({"torch": step, "kernel": step}, args.reps)
                print(f"{dtype_name:>9} {kv_name:>9} {kind:>8} {b:>5} {context_len:>8} {best['torch']:>16.1f} "
                      f"{best['kernel']:>10.1f} {best['torch'] / best['kernel']:>7.1f}x")  # fmt: skip


if __name__ == "__main__":
    main()
