"""Base-model throughput: loraserve vs transformers `generate` on the same batch, in one run.

SmolLM-135M-shaped random Llama (or `--shape gemma2-2b` / `gemma3-1b` / `phi3.5-mini` / `olmoe-2l`:
random models of those configs; `--num-layers N` keeps their first N layers; the MoE one takes
`--skip-ceiling`), 32 requests, greedy, fixed prompt and output lengths.
Usage: python benchmarks/throughput.py [--shape smollm] [--num-requests 32] [--prompt-len 64] [--gen-len 64]
       [--dtype auto] [--repeats 3] [--skip-ceiling] [--num-layers N]
"""

from __future__ import annotations

import argparse
import platform
from collections.abc import Callable

import torch

from benchmarks.common import (
    GEMMA_SHAPES,
    MOE_SHAPES,
    TIMED_RUNS,
    build_gemma_model,
    build_model,
    build_moe_model,
    interleaved_timed,
    print_table,
    random_prompts,
    save_results,
    steady_timed,
)
from loraserve import LLM, SamplingParams
from loraserve.config import resolve_device, resolve_dtype


def run_transformers(path: str, prompts: list[list[int]], gen_len: int, dtype: torch.dtype,
                     repeats: int = TIMED_RUNS) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval()
    batch = torch.tensor(prompts)  # equal lengths: no padding needed
    kwargs = dict(max_new_tokens=gen_len, min_new_tokens=gen_len, do_sample=False, pad_token_id=0)
    with torch.inference_mode():
        seconds, out = steady_timed(lambda ids: model.generate(torch.tensor(ids), **kwargs), prompts, repeats)
    assert out.shape[1] == batch.shape[1] + gen_len
    return len(prompts) * gen_len / seconds


def loraserve_run(path: str, num_requests: int, gen_len: int, dtype: str,
                  max_model_len: int | None = None) -> Callable[[list[list[int]]], None]:
    """One greedy `generate` over the given prompts, of fixed-length outputs (checked)."""
    llm = LLM(path, dtype=dtype, max_num_seqs=num_requests, max_model_len=max_model_len)
    params = SamplingParams(temperature=0.0, max_tokens=gen_len, ignore_eos=True)

    def run(ids: list[list[int]]) -> None:
        outs = llm.generate([{"prompt_token_ids": p} for p in ids], params, use_tqdm=False)
        assert all(len(o.outputs[0].token_ids) == gen_len for o in outs)
    return run


def matmul_floor_run(path: str, num_requests: int, prompt_len: int, gen_len: int,
                     dtype: torch.dtype) -> Callable[[], None]:
    """Generated tok/s of a plain loop over only the model's linear layers (no attention, no
    sampling, no framework), with the same packed weights and kernels loraserve uses (the C linear
    kernel where it serves the dtype, else oneDNN):
    the ceiling for any engine on this machine in this dtype."""
    from transformers import AutoConfig

    from loraserve.layers.linear import Linear, pack_cpu_linears

    cfg = AutoConfig.from_pretrained(path)
    hidden, inter = cfg.hidden_size, cfg.intermediate_size
    head_dim = getattr(cfg, "head_dim", None) or hidden // cfg.num_attention_heads
    q_size = cfg.num_attention_heads * head_dim
    qkv = q_size + 2 * cfg.num_key_value_heads * head_dim
    shapes = [(hidden, qkv), (q_size, hidden), (hidden, 2 * inter), (inter, hidden)]
    # Distinct weights per transformer layer, as in the model (reusing one set would flatter the cache).
    layers = [[Linear(inp, out, dtype=dtype) for inp, out in shapes] for _ in range(cfg.num_hidden_layers)]
    lm_head = Linear(hidden, cfg.vocab_size, dtype=dtype)
    every = [layer for group in layers for layer in group] + [lm_head]
    for layer in every:
        layer.weight.data.normal_()
    pack_cpu_linears(torch.nn.ModuleList(every))
    inputs = {(m, inp): torch.randn(m, inp, dtype=dtype) for m in (num_requests * prompt_len, num_requests)
              for inp, _ in shapes}

    def step(rows: int) -> None:
        for group in layers:
            for (inp, _), layer in zip(shapes, group):
                layer.base_forward(inputs[(rows, inp)])
        lm_head.base_forward(inputs[(num_requests, hidden)])

    def run() -> None:
        with torch.inference_mode():
            step(num_requests * prompt_len)
            for _ in range(gen_len - 1):
                step(num_requests)
    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--num-requests", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--gen-len", type=int, default=64)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--shape", default="smollm", choices=["smollm", *GEMMA_SHAPES, *MOE_SHAPES])
    parser.add_argument("--repeats", type=int, default=TIMED_RUNS, help="timed runs per system (the best counts)")
    parser.add_argument("--skip-ceiling", action="store_true", help="leave out the linear-layers-only row")
    parser.add_argument("--num-layers", type=int, default=None, help="keep the shape's first N layers only")
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype, resolve_device("cpu"))
    dtype_name = str(dtype).replace("torch.", "")
    shapes = {**GEMMA_SHAPES, **MOE_SHAPES}
    if args.shape == "smollm":
        path = build_model()
    elif args.shape in MOE_SHAPES:
        path = build_moe_model(args.shape)
    else:
        path = build_gemma_model(args.shape, args.num_layers)
    vocab_size = 49152 if args.shape == "smollm" else shapes[args.shape]["vocab_size"]
    prompts = random_prompts(args.num_requests, args.prompt_len, vocab_size)
    print(f"{platform.processor() or platform.machine()}, torch threads={torch.get_num_threads()}, {dtype_name}, "
          f"{args.shape}{'' if args.num_layers is None else f' ({args.num_layers} layers)'}, {args.num_requests} requests x ({args.prompt_len} prompt + {args.gen_len} generated) tokens")
    hf = run_transformers(path, prompts, args.gen_len, dtype, args.repeats)
    # Phi-3.5's 131072 positions would not fit a KV cache here; the run needs prompt + generated tokens.
    max_model_len = 4096 if args.shape == "phi3.5-mini" else None
    runs = {"ours": loraserve_run(path, args.num_requests, args.gen_len, dtype_name, max_model_len)}
    if not args.skip_ceiling:
        ceiling = matmul_floor_run(path, args.num_requests, args.prompt_len, args.gen_len, dtype)
        runs["floor"] = lambda ids: ceiling()
    timings = interleaved_timed(runs, prompts, args.repeats)  # their ratio is the figure: timed in turn
    rates = {key: args.num_requests * args.gen_len / timing[0] for key, timing in timings.items()}
    rows = [("transformers generate", hf), ("loraserve", rates["ours"])]
    if "floor" in rates:
        rows.append(("linear layers only (ceiling)", rates["floor"]))
    print_table("Base-model throughput", rows, "transformers generate")
    name = "throughput" if args.shape == "smollm" else f"throughput-{args.shape}"
    name += "" if args.num_layers is None else f"-{args.num_layers}l"
    save_results(name, {"dtype": dtype_name, "args": vars(args), "tok_per_s": dict(rows)})


if __name__ == "__main__":
    main()
