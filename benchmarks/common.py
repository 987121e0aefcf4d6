"""Shared benchmark setup: the SmolLM-135M-shaped random model, its adapters, prompts and timing."""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

import torch

from benchmarks import measure
from loraserve import envs
from loraserve.demo.random_model import build_tokenizer, llama_config, save_peft_adapter, save_random_model

SMOLLM_SHAPE = dict(
    hidden_size=576,
    intermediate_size=1536,
    num_hidden_layers=30,
    num_attention_heads=9,
    num_key_value_heads=3,
    max_position_embeddings=2048,
    tie_word_embeddings=True,
)
# The real configs' shapes (random weights; the 256k vocabularies kept: their LM head is a real share
# of a step). Gemma-2-2B: 26 layers, 8 heads over 4 KV heads of 256, softcaps, 4096-token window on
# every other layer; Gemma-3-1B: 26 layers, 4 heads over 1 KV head of 256, 512-token window on 5 of
# every 6 layers, q/k norms, two rope bases.
GEMMA_SHAPES: dict[str, dict[str, Any]] = {
    "gemma2-2b": dict(
        model_type="gemma2",
        vocab_size=256000,
        hidden_size=2304,
        intermediate_size=9216,
        num_hidden_layers=26,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=4096,
        attn_logit_softcapping=50.0,
        final_logit_softcapping=30.0,
        max_position_embeddings=8192,
    ),
    "gemma3-1b": dict(
        model_type="gemma3_text",
        vocab_size=262144,
        hidden_size=1152,
        intermediate_size=6912,
        num_hidden_layers=26,
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=256,
        query_pre_attn_scalar=256,
        sliding_window=512,
        max_position_embeddings=32768,
    ),
    # Phi-3.5-mini: 32 layers, 32 heads of 96 (no GQA), fused qkv/gate_up, LongRoPE from 4096 to 131072
    # (48 factors each; these stand in for the checkpoint's, short near 1, long up to ~60).
    "phi3.5-mini": dict(
        model_type="phi3",
        vocab_size=32064,
        hidden_size=3072,
        intermediate_size=8192,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        max_position_embeddings=131072,
        original_max_position_embeddings=4096,
        sliding_window=262144,
        rope_parameters=dict(
            rope_type="longrope",
            rope_theta=10000.0,
            partial_rotary_factor=1.0,
            original_max_position_embeddings=4096,
            short_factor=[1.0 + 2.0 * i / 47 for i in range(48)],
            long_factor=[1.0 + 59.0 * i / 47 for i in range(48)],
        ),
    ),
}
# OLMoE-1B-7B's layer shape (hidden 2048, 16 heads, 64 experts of 1024, 8 per token, its 50k vocabulary)
# with 2 of its 16 layers, so that the random model fits in 2 GB of bf16.
MOE_SHAPES: dict[str, dict[str, Any]] = {
    "olmoe-2l": dict(
        model_type="olmoe",
        vocab_size=50304,
        hidden_size=2048,
        intermediate_size=1024,
        num_hidden_layers=2,
        num_attention_heads=16,
        num_key_value_heads=16,
        num_experts=64,
        num_experts_per_tok=8,
        norm_topk_prob=False,
        max_position_embeddings=4096,
    ),
}
ALL_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def bench_root() -> str:
    return os.path.join(envs.cache_root(), "bench-smollm135m")


def build_model(vocab_size: int = 49152, max_position_embeddings: int | None = None) -> str:
    """The random SmolLM-135M-shaped Llama (built once, cached); a longer `max_position_embeddings`
    than SmolLM's 2048 gives a variant in its own folder (same seed, so the same weights)."""
    shape = dict(SMOLLM_SHAPE)
    name = "model"
    if max_position_embeddings is not None and max_position_embeddings != shape["max_position_embeddings"]:
        shape["max_position_embeddings"] = max_position_embeddings
        name = f"model-pos{max_position_embeddings}"
    path = os.path.join(bench_root(), name)
    if not os.path.exists(os.path.join(path, "config.json")):
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        build_tokenizer(tmp, vocab_size=512)
        save_random_model(tmp, llama_config(vocab_size, **shape), seed=0)
        os.replace(tmp, path)
    return path


def build_gemma_model(shape: str, num_layers: int | None = None) -> str:
    """A random model of one of `GEMMA_SHAPES` in bf16 (built once, cached), with the bench tokenizer;
    `num_layers` keeps only the first layers (a short run of a model too large for the machine)."""
    from transformers import AutoConfig

    values = dict(GEMMA_SHAPES[shape])
    path = os.path.join(bench_root(), shape)
    if num_layers is not None and num_layers != values["num_hidden_layers"]:
        values["num_hidden_layers"] = num_layers
        path += f"-{num_layers}l"
    if not os.path.exists(os.path.join(path, "config.json")):
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        build_tokenizer(tmp, vocab_size=512)
        config = AutoConfig.for_model(values.pop("model_type"), bos_token_id=1, eos_token_id=2, **values)
        save_random_model(tmp, config, seed=0, dtype=torch.bfloat16)
        os.replace(tmp, path)
    return path


def build_moe_model(shape: str) -> str:
    """A random model of one of `MOE_SHAPES` in bf16 (built once, cached), with the bench tokenizer."""
    from transformers import AutoConfig

    values = dict(MOE_SHAPES[shape])
    path = os.path.join(bench_root(), shape)
    if not os.path.exists(os.path.join(path, "config.json")):
        tmp = path + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        build_tokenizer(tmp, vocab_size=512)
        config = AutoConfig.for_model(values.pop("model_type"), bos_token_id=1, eos_token_id=2, **values)
        save_random_model(tmp, config, seed=0, dtype=torch.bfloat16)
        os.replace(tmp, path)
    return path


def build_adapters(model_path: str, count: int, rank: int = 16) -> list[str]:
    """`count` rank-`rank` PEFT adapters on all 7 projections (built once, cached)."""
    from transformers import AutoModelForCausalLM

    root = os.path.join(bench_root(), f"adapters-r{rank}")
    paths = [os.path.join(root, f"a{i:03d}") for i in range(count)]
    missing = [i for i, p in enumerate(paths) if not os.path.exists(os.path.join(p, "adapter_config.json"))]
    if missing:
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        for i in missing:
            save_peft_adapter(
                base,
                paths[i],
                seed=1000 + i,
                base_name=model_path,
                r=rank,
                lora_alpha=2 * rank,
                target_modules=ALL_TARGETS,
            )
    return paths


def limit_threads(num_threads: int | None) -> None:
    """Use `num_threads` compute threads here and in child processes (torch's pool and the OpenMP of
    the C kernels); None keeps the defaults. On cores shared with other jobs, 1 avoids the threads
    waiting at every op's barrier for a sibling that is descheduled (steps 10-30x slower)."""
    if num_threads is None:
        return
    os.environ["OMP_NUM_THREADS"] = str(num_threads)
    torch.set_num_threads(num_threads)


def cpu_class() -> str:
    """This machine's CPU as the notes name it (model, family and model numbers, the vector extensions
    that pick our code paths) and the torch thread count."""
    return f"{measure.describe_cpu()}, {torch.get_num_threads()} threads"


def random_prompts(num: int, length: int, vocab_size: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(10, vocab_size, (length,), generator=g).tolist() for _ in range(num)]


def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    result = fn()
    return time.perf_counter() - start, result


def other_prompts(prompts: list[list[int]], shift: int = 1, vocab_size: int = 49152) -> list[list[int]]:
    """Prompts of the same lengths with other tokens (each shift gives others): runs on them share no
    prefix-cache block with a run on `prompts`."""
    return [[10 + (token + shift - 10) % (vocab_size - 10) for token in prompt] for prompt in prompts]


TIMED_RUNS = 3


def steady_timed(
    run: Callable[[list[list[int]]], Any], prompts: list[list[int]], repeats: int = TIMED_RUNS
) -> tuple[float, Any]:
    """Seconds of `run(prompts)` in steady state, and its result: `run` goes once untimed, then
    `repeats` timed runs, each on same-shaped prompts of its own (no prefix-cache hit between them),
    and the fastest counts. First-touch page faults, allocator growth and lazily built kernels fall
    outside the timing, and so does most of what other tenants of a shared machine do to one run.
    Every system in a table is timed this way, so the rows compare like with like."""
    run(other_prompts(prompts, shift=repeats + 1))
    best: tuple[float, Any] | None = None
    for shift in range(repeats):
        batch = other_prompts(prompts, shift) if shift else prompts
        timing = timed(lambda: run(batch))  # noqa: B023  (called at once, inside this iteration)
        if best is None or timing[0] < best[0]:
            best = timing
    assert best is not None
    return best


def interleaved_timed(
    runs: dict[str, Callable[[list[list[int]]], Any]], prompts: list[list[int]], repeats: int = TIMED_RUNS
) -> dict[str, tuple[float, Any]]:
    """`steady_timed` for systems whose ratio is the figure: each goes once untimed, then `repeats`
    rounds time every system once in turn, and each keeps its fastest run. A shared machine's speed
    drifts over seconds; timed back to back in one window each, two systems would be compared across
    different machine states, and their ratio would swing by more than the differences it measures.
    Every run gets prompts of its own (same shapes): no prefix-cache hit between any two."""
    names = list(runs)
    for i, name in enumerate(names):
        runs[name](other_prompts(prompts, shift=(repeats + 1) * len(names) + i))
    best: dict[str, tuple[float, Any]] = {}
    for round_index in range(repeats):
        for i, name in enumerate(names):
            shift = round_index * len(names) + i
            batch = other_prompts(prompts, shift) if shift else prompts
            timing = timed(lambda: runs[name](batch))  # noqa: B023  (called at once, inside this iteration)
            if name not in best or timing[0] < best[name][0]:
                best[name] = timing
    return best


def print_table(title: str, rows: list[tuple[str, float]], reference: str) -> None:
    ref = dict(rows)[reference]
    print(f"\n{title}")
    print(f"{'system':<44}{'gen tok/s':>12}{'vs ' + reference:>28}")
    for name, tps in rows:
        print(f"{name:<44}{tps:>12.1f}{tps / ref:>27.2f}x")


RESULTS_DIR = os.path.join(os.path.dirname(__file__), "results")


def save_results(name: str, data: dict[str, Any]) -> bool:
    """Save `data` as results/NAME.json with the run's `conditions` (benchmarks/measure.py: CPU class,
    threads, load average before and after, read bandwidth), printed too; False, and nothing written,
    when the run started on a busy machine without --allow-busy."""
    cond = measure.conditions()
    if not measure.check_and_print(name, cond):
        return False
    os.makedirs(RESULTS_DIR, exist_ok=True)
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w", encoding="utf-8") as f:
        json.dump({**data, "conditions": cond}, f, indent=2)
    return True


def report_vs_plain(
    result_name: str,
    runs: dict[str, Callable[[list[list[int]]], Any]],
    num_requests: int,
    prompt_len: int,
    gen_len: int,
    dtype: str,
    vocab_size: int,
) -> None:
    """Time `runs` interleaved on the same prompts, print each one's tok/s against the "plain" run,
    and save the result as `result_name` (with the CPU class)."""
    prompts = random_prompts(num_requests, prompt_len, vocab_size, seed=5)
    timings = interleaved_timed(runs, prompts)
    tok_s = {name: num_requests * gen_len / seconds for name, (seconds, _) in timings.items()}
    where = cpu_class()
    print(f"\n{num_requests} requests, {prompt_len} prompt + {gen_len} generated tokens, {dtype}; {where}")
    for name, value in tok_s.items():
        print(f"  {name:<8}{value:>8.1f} tok/s  {value / tok_s['plain']:.3f}x plain")
    vs_plain = {k: v / tok_s["plain"] for k, v in tok_s.items()}
    save_results(result_name, {"cpu": where, "dtype": dtype, "tok_per_s": tok_s, "vs_plain": vs_plain})


def adapter_bench(doc: str | None, num_requests: int) -> tuple[Any, str, Any]:
    """The shared start of the adapter-batch benchmarks: their command line (--dtype, --threads,
    --prompt-len, --gen-len), the random model, and an LLM with a slot per request."""
    import argparse

    from loraserve import LLM

    parser = argparse.ArgumentParser(description=doc, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--gen-len", type=int, default=16)
    args = parser.parse_args()
    limit_threads(args.threads)
    path = build_model()
    llm = LLM(
        path,
        dtype=args.dtype,
        max_num_seqs=num_requests,
        enable_lora=True,
        max_loras=num_requests,
        max_lora_rank=16,
        max_cpu_loras=64,
    )
    return args, path, llm
