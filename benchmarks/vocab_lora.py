"""A batch of 16 requests over 16 rank-16 adapters on all 7 projections, against the same batch whose
adapters also carry rank-16 LoRA on embed_tokens and lm_head (issue 27 item 4): generated tok/s,
timed in turn (`interleaved_timed`), the ratio the figure. The vocab terms cost, per token, a gather of
one A^T row and a rank-16 expand at the input, and a rank-16 LoRA over the 49152-wide head per sampled
row. SmolLM-135M-shaped random Llama (benchmarks.common).
Usage: python -m benchmarks.vocab_lora [--dtype auto] [--threads 1] [--gen-len 16]
"""

from __future__ import annotations

import os

import torch

from benchmarks.common import (
    ALL_TARGETS,
    adapter_bench,
    bench_root,
    build_adapters,
    report_vs_plain,
)
from benchmarks.lora_throughput import generate_run
from loraserve import LoRARequest

VOCAB_SIZE = 49152
NUM_REQUESTS = 16


def build_vocab_adapters(model_path: str, count: int, rank: int = 16) -> list[str]:
    """`count` adapters on all 7 projections plus embed_tokens and lm_head (built once, cached; PEFT's
    copies of the base embedding and head are not saved)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    root = os.path.join(bench_root(), f"adapters-vocab-r{rank}")
    paths = [os.path.join(root, f"a{i:03d}") for i in range(count)]
    for i, path in enumerate(paths):
        if os.path.exists(os.path.join(path, "adapter_config.json")):
            continue
        torch.manual_seed(2000 + i)
        base = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
        targets = [*ALL_TARGETS, "embed_tokens", "lm_head"]
        model = get_peft_model(base, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, 0.02)
        model.peft_config["default"].base_model_name_or_path = model_path
        model.save_pretrained(path, save_embedding_layers=False)
    return paths


def main() -> None:
    args, path, llm = adapter_bench(__doc__, NUM_REQUESTS)
    plain = [LoRARequest(f"r16-{i}", i + 1, p) for i, p in enumerate(build_adapters(path, NUM_REQUESTS, 16))]
    vocab = [
        LoRARequest(f"v16-{i}", 100 + i, p) for i, p in enumerate(build_vocab_adapters(path, NUM_REQUESTS))
    ]
    runs = {
        "plain": generate_run(llm, args.gen_len, list(plain)),
        "vocab": generate_run(llm, args.gen_len, list(vocab)),
    }
    report_vs_plain("vocab_lora", runs, NUM_REQUESTS, args.prompt_len, args.gen_len, args.dtype, VOCAB_SIZE)


if __name__ == "__main__":
    main()
