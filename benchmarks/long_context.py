"""Decode step time at long contexts: loraserve vs transformers, B sequences at each context length.

loraserve: B random prompts a little shorter than `ctx` are prefilled (one-token requests, so their
KV lands in the prefix cache), then B requests with those prompts go through the engine; once all of
them decode, `steps` further engine steps (pure decode of all B, each token attending to a few tokens
less than `ctx` cached ones) are timed one by one.
transformers: the model's own decode step, a [B, 1] forward with a `DynamicCache` already holding
`ctx - 1` random keys and values per layer (no prefill to pay for), plus the greedy pick; the cache is
cropped back after each step so every step sees the same context.
Both report the median step in milliseconds.
The KV-read bound (issue 26): what the step costs at the longest context over the shortest, against
the time to read the extra KV once (batch x extra tokens x layers x K and V rows) at the read bandwidth
measured in the same run (`benchmarks.bandwidth`), for loraserve's engine step and for its attention
alone (`benchmarks.attention`'s step over the model's layers, caches of that context); goal <= 1.5x.
Usage: python -m benchmarks.long_context [--contexts 128,1024,2048] [--batch 16] [--steps 8] [--dtype auto]
       python -m benchmarks.long_context --contexts 128,1900 --no-transformers --threads 1  (the bound row)
       python -m benchmarks.long_context --contexts 128,1900 --kv-cache-dtypes auto,bfloat16,int8,fp8
         (the bound for each --kv-cache-dtype: its extra KV bytes, int8's block scales included)
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import time
from typing import Any

import torch

from benchmarks.attention import make_step
from benchmarks.bandwidth import probe_buffer, read_bandwidth_gbs, read_once_gbs
from benchmarks.common import build_model, cpu_class, limit_threads, random_prompts, save_results
from loraserve import LLM, SamplingParams
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.cache_config import kv_cache_torch_dtype
from loraserve.config import resolve_device, resolve_dtype

SMOLLM_MAX_POSITIONS = 2048
VOCAB_SIZE = 49152


def model_for(contexts: list[int]) -> str:
    """The benchmark model, with room for positions past SmolLM's 2048 when a context needs them."""
    longest = max(contexts)
    if longest <= SMOLLM_MAX_POSITIONS:
        return build_model()
    return build_model(max_position_embeddings=1 << math.ceil(math.log2(longest)))


def loraserve_step_ms(llm: LLM, ctx: int, batch: int, steps: int, tag: str, seed: int = 0) -> float:
    """Median milliseconds of one engine step decoding `batch` sequences at context ~`ctx`."""
    engine = llm.engine
    # Chunked prefill lets the first sequences decode while the last ones still prefill: leave them
    # room for those extra tokens, so none finishes before the timed steps are over.
    num_prefill_steps = math.ceil(batch * ctx / engine.config.scheduler.max_num_batched_tokens) + 1
    max_tokens = steps + num_prefill_steps + 1
    if ctx <= 2 * max_tokens:
        raise ValueError(f"context {ctx} is too short for {steps} timed steps of {batch} sequences")
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    # Fresh prompts per run: no prefix-cache hit shortens any prefill or shares any KV block.
    prompts = random_prompts(batch, ctx - max_tokens, VOCAB_SIZE, seed=(seed << 20) + ctx)
    # The prompts' KV first, as pure prefills: one-token requests end at their first token, leaving
    # their blocks in the prefix cache for the batch below. (Prefilling the batch itself would mix
    # prefill chunks with the first sequences' decodes, and those steps pad every decode row to the
    # chunk length in attention: the setup would cost many times the measurement.)
    llm.generate([{"prompt_token_ids": p} for p in prompts], SamplingParams(max_tokens=1), use_tqdm=False)
    hits_before = engine.block_manager.num_prefix_hits
    request_ids = [f"{tag}-{ctx}-{i}" for i in range(batch)]
    for request_id, prompt in zip(request_ids, prompts):
        engine.add_request(request_id, {"prompt_token_ids": prompt}, params)
    started: set[str] = set()
    while len(started) < batch:
        for output in engine.step():
            if output.outputs and output.outputs[0].token_ids:
                started.add(output.request_id)
    assert engine.block_manager.num_prefix_hits - hits_before == batch, "the prompts' KV was not reused"
    times = []
    for _ in range(steps):
        begin = time.perf_counter()
        outputs = engine.step()
        times.append(time.perf_counter() - begin)
        assert len(outputs) == batch, f"a decode step returned {len(outputs)} of {batch} sequences"
    engine.abort_request(request_ids)
    return 1000 * statistics.median(times)


def make_llm(path: str, dtype: str, contexts: list[int], batch: int, kv_cache_dtype: str = "auto") -> LLM:
    """An engine whose KV cache holds `batch` sequences of the longest context, cached prompt
    blocks plus a few blocks each for the decoded tokens."""
    block_size = 16
    blocks_per_seq = math.ceil(max(contexts) / block_size) + 4
    return LLM(
        path,
        dtype=dtype,
        max_num_seqs=batch,
        block_size=block_size,
        num_kv_blocks=batch * blocks_per_seq,
        max_model_len=max(contexts),
        kv_cache_dtype=kv_cache_dtype,
    )


def filled_cache(model: Any, batch: int, length: int, dtype: torch.dtype) -> Any:
    """A DynamicCache holding `length` random keys and values per layer for `batch` sequences."""
    from transformers import DynamicCache

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    g = torch.Generator().manual_seed(length)
    shape = (batch, cfg.num_key_value_heads, length, head_dim)
    for layer in range(cfg.num_hidden_layers):
        keys = torch.randn(shape, generator=g).to(dtype)
        values = torch.randn(shape, generator=g).to(dtype)
        cache.update(keys, values, layer)
    return cache


def transformers_step_ms(model: Any, ctx: int, batch: int, steps: int, dtype: torch.dtype) -> float:
    """Median milliseconds of transformers' decode step (forward of [batch, 1] + greedy pick) at `ctx`."""
    cache = filled_cache(model, batch, ctx - 1, dtype)
    tokens = torch.randint(10, VOCAB_SIZE, (batch, 1), generator=torch.Generator().manual_seed(ctx))
    position_ids = torch.full((batch, 1), ctx - 1, dtype=torch.long)
    attention_mask = torch.ones(batch, ctx, dtype=torch.long)
    times = []
    with torch.inference_mode():
        for _ in range(steps + 1):  # the first step is a warm-up
            begin = time.perf_counter()
            out = model(
                input_ids=tokens,
                attention_mask=attention_mask,
                position_ids=position_ids,
                cache=cache,
                use_cache=True,
            )
            next_tokens = out.logits[:, -1].argmax(dim=-1, keepdim=True)
            times.append(time.perf_counter() - begin)
            assert cache.get_seq_length() == ctx
            cache.crop(-1)  # back to ctx - 1 tokens: every step decodes at the same context
            tokens = next_tokens
    return 1000 * statistics.median(times[1:])


def run_long_context(
    path: str,
    dtype: torch.dtype,
    contexts: list[int],
    batch: int = 16,
    steps: int = 8,
    with_transformers: bool = True,
    kv_cache_dtype: str = "auto",
) -> dict[int, dict[str, float]]:
    """{ctx: {"loraserve_ms": .., "transformers_ms": ..}}: median decode step of `batch` sequences."""
    from transformers import AutoModelForCausalLM

    contexts = sorted(contexts)
    results: dict[int, dict[str, float]] = {ctx: {} for ctx in contexts}
    dtype_name = str(dtype).replace("torch.", "")
    llm = make_llm(path, dtype_name, contexts, batch, kv_cache_dtype)
    # Warm-up at the shortest context, same batch: the first steps of a shape build its kernels
    # (oneDNN primitives, C kernels) and settle the allocator; both systems get one.
    loraserve_step_ms(llm, contexts[0], batch, 2, "warm-up", seed=1)
    for ctx in contexts:
        results[ctx]["loraserve_ms"] = loraserve_step_ms(llm, ctx, batch, steps, "long")
        print(f"  loraserve ctx={ctx}: {results[ctx]['loraserve_ms']:.1f} ms/step", flush=True)
    del llm
    if not with_transformers:
        return results
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    transformers_step_ms(model, contexts[0], batch, 2, dtype)  # warm-up, as above
    for ctx in contexts:
        results[ctx]["transformers_ms"] = transformers_step_ms(model, ctx, batch, steps, dtype)
        print(f"  transformers ctx={ctx}: {results[ctx]['transformers_ms']:.1f} ms/step", flush=True)
    return results


def model_shape(path: str) -> dict[str, int]:
    """The attention shape of the model at `path` (its config.json): layers, heads, KV heads, head dim."""
    with open(os.path.join(path, "config.json"), encoding="utf-8") as f:
        cfg = json.load(f)
    heads = cfg["num_attention_heads"]
    return {
        "layers": cfg["num_hidden_layers"],
        "heads": heads,
        "kv_heads": cfg.get("num_key_value_heads", heads),
        "head_dim": cfg.get("head_dim") or cfg["hidden_size"] // heads,
    }


def kv_bytes_per_token(shape: dict[str, int], dtype: torch.dtype, block_size: int = 16) -> float:
    """Bytes of one token's K and V rows over every layer in the cache's element dtype (int8's block
    scales shared out over a block's tokens): what one more token of context reads."""
    spec = KVCacheSpec(shape["layers"], shape["kv_heads"], shape["head_dim"])
    return spec.block_bytes(block_size, dtype) / block_size


def attention_step_ms(
    shape: dict[str, int],
    dtype: torch.dtype,
    contexts: list[int],
    batch: int,
    reps: int,
    kv_dtype: torch.dtype | None = None,
) -> tuple[dict[int, float], float]:
    """({ctx: ms}, GB/s): the decode step's attention alone (KV write + kernel, every layer) and the
    read bandwidth, each the best of `reps`; the contexts and the bandwidth probe take turns, so that
    all of them see the same machine load (on shared cores it swings by several times in a minute)."""
    args = argparse.Namespace(block_size=16, **shape)
    steps = {ctx: make_step(args, batch, 1, ctx, dtype, kv_dtype) for ctx in contexts}
    probe = probe_buffer()
    best, gbs = dict.fromkeys(contexts, float("inf")), 0.0
    with torch.inference_mode():
        for rep in range(reps + 1):  # the first round warms up (kernel build, page faults)
            for ctx, step in steps.items():
                begin = time.perf_counter()
                step()
                if rep:
                    best[ctx] = min(best[ctx], 1000 * (time.perf_counter() - begin))
            gbs = max(gbs, read_once_gbs(probe))
    return best, gbs


def kv_bound(ms_short: float, ms_long: float, extra_bytes: int, gbs: float) -> dict[str, float]:
    """The extra step time of the long context against reading its extra KV once at `gbs`."""
    bound_ms = extra_bytes / (gbs * 1e9) * 1e3
    return {"extra_ms": ms_long - ms_short, "bound_ms": bound_ms, "ratio": (ms_long - ms_short) / bound_ms}


def print_kv_bound(rows: dict[str, dict[str, float]], short: int, long: int, batch: int) -> None:
    print(
        f"\nKV-read bound: {batch} seqs, {long} vs {short} tokens of context: the extra KV of each format"
        " read once at the read bandwidth measured beside each row"
    )
    print(
        f"{'':>28}{f'ms@{short}':>10}{f'ms@{long}':>11}{'extra ms':>10}{'GB/s':>7}{'bound ms':>10}{'ratio':>8}"
        "  (goal <= 1.5x)"
    )
    for name, row in rows.items():
        print(
            f"{name:>28}{row['short_ms']:>10.1f}{row['long_ms']:>11.1f}{row['extra_ms']:>10.1f}"
            f"{row['read_gbs']:>7.1f}{row['bound_ms']:>10.1f}{row['ratio']:>7.2f}x"
        )


def print_long_context(results: dict[int, dict[str, float]]) -> None:
    print(f"\n{'context':>8}{'loraserve ms':>15}{'transformers ms':>18}{'speed-up':>11}")
    for ctx, row in sorted(results.items()):
        ours, theirs = row["loraserve_ms"], row["transformers_ms"]
        print(f"{ctx:>8}{ours:>15.1f}{theirs:>18.1f}{theirs / ours:>10.2f}x")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--contexts", default="128,1024,2048", help="comma-separated context lengths (tokens)"
    )
    parser.add_argument("--batch", type=int, default=16, help="sequences decoded together")
    parser.add_argument("--steps", type=int, default=8, help="timed decode steps per context (median)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument(
        "--threads", type=int, default=None, help="compute threads (1 on cores shared with other jobs)"
    )
    parser.add_argument(
        "--kv-cache-dtypes", default="auto", help="KV cache formats to time, e.g. auto,bfloat16,int8,fp8"
    )
    parser.add_argument("--no-transformers", action="store_true", help="loraserve and the KV-read bound only")
    parser.add_argument("--attention-only", action="store_true", help="the attention row of the bound only")
    parser.add_argument("--tag", default="", help="saved as long_context_<tag> (a CPU class's own run)")
    args = parser.parse_args()
    limit_threads(args.threads)
    contexts = sorted(int(x) for x in args.contexts.split(","))
    dtype = resolve_dtype(args.dtype, resolve_device("cpu"))
    dtype_name = str(dtype).replace("torch.", "")
    print(
        f"{cpu_class()}, torch threads={torch.get_num_threads()}, {dtype_name}, batch {args.batch}, "
        f"median of {args.steps} decode steps"
    )
    path = model_for(contexts)
    shape = model_shape(path)
    short, long = contexts[0], contexts[-1]
    kv_names = args.kv_cache_dtypes.split(",")
    by_kv: dict[str, dict[int, dict[str, float]]] = {}
    gbs = []
    if not args.attention_only:
        gbs.append(read_bandwidth_gbs())
        for i, kv in enumerate(kv_names):  # transformers once: its cache is the model dtype's
            with_transformers = not args.no_transformers and i == 0
            by_kv[kv] = run_long_context(path, dtype, contexts, args.batch, args.steps, with_transformers, kv)
        gbs.append(read_bandwidth_gbs())  # before and after: the faster bounds the steps harder
    bound_rows = {}
    for kv in kv_names:
        kv_dtype = kv_cache_torch_dtype(kv, dtype)
        attention, attention_gbs = attention_step_ms(
            shape, dtype, [short, long], args.batch, args.steps, kv_dtype
        )
        extra_bytes = int(args.batch * (long - short) * kv_bytes_per_token(shape, kv_dtype))
        rows = [(f"attention only, {kv} KV", attention[short], attention[long], attention_gbs)]
        if kv in by_kv:
            steps = by_kv[kv]
            rows.insert(
                0,
                (
                    f"engine step, {kv} KV",
                    steps[short]["loraserve_ms"],
                    steps[long]["loraserve_ms"],
                    max(gbs),
                ),
            )
        for name, short_ms, long_ms, row_gbs in rows:
            bound_rows[name] = {"short_ms": short_ms, "long_ms": long_ms, "read_gbs": row_gbs,
                                "extra_kv_mb": extra_bytes / 1e6, **kv_bound(short_ms, long_ms, extra_bytes, row_gbs)}  # fmt: skip
    results = by_kv.get(kv_names[0], {})
    if results and not args.no_transformers:
        print_long_context(results)
    print_kv_bound(bound_rows, short, long, args.batch)
    save_results(
        f"long_context_{args.tag}" if args.tag else "long_context",
        {
            "cpu": cpu_class(),
            "dtype": dtype_name,
            "args": vars(args),
            "steps_ms": {str(ctx): row for ctx, row in results.items()},
            "steps_ms_by_kv_cache_dtype": {
                kv: {str(c): r for c, r in rows.items()} for kv, rows in by_kv.items()
            },
            "kv_bound": bound_rows,
        },
    )


if __name__ == "__main__":
    main()
