"""A batch of 16 requests, each with its own LoRA scale or its own adapter mix, against the same batch
with plain adapters: generated tok/s, timed in turn (`interleaved_timed`), the ratios the figure.

- plain: 16 requests over 16 rank-16 adapters (one slot each, 16 slots).
- scaled: the same 16 requests, each at its own scale (0.25 to 2.125): the same slots, plus one
  multiply of t = A x per token per LoRA layer.
- mixed: 16 requests, each a mix of its own two of 8 rank-8 adapters with its own weights: each mix is
  one rank-16 virtual adapter in a slot, so the step reads as many adapter weights as the plain batch.
SmolLM-135M-shaped random Llama (benchmarks.common), all 7 projections adapted.
Usage: python -m benchmarks.lora_scale_mix [--dtype auto] [--threads 1] [--gen-len 16]
"""

from __future__ import annotations

from benchmarks.common import (
    adapter_bench,
    build_adapters,
    report_vs_plain,
)
from benchmarks.lora_throughput import generate_run
from loraserve import LoRARequest

VOCAB_SIZE = 49152
NUM_REQUESTS = 16


def batches(path: str) -> dict[str, list[LoRARequest | None]]:
    """The three batches' adapter per request."""
    plain = [
        LoRARequest(f"r16-{i}", i + 1, p) for i, p in enumerate(build_adapters(path, NUM_REQUESTS, rank=16))
    ]
    parts = [LoRARequest(f"r8-{i}", 100 + i, p) for i, p in enumerate(build_adapters(path, 8, rank=8))]
    scaled = [
        LoRARequest(r.lora_name, r.lora_id, r.lora_path, scale=0.25 + 0.125 * i) for i, r in enumerate(plain)
    ]
    mixed = [
        LoRARequest.mixed([(parts[i % 8], 0.3 + 0.05 * i), (parts[(i // 8 + 1 + i) % 8], 0.7)], 200 + i)
        for i in range(NUM_REQUESTS)
    ]
    return {"plain": list(plain), "scaled": list(scaled), "mixed": list(mixed)}


def main() -> None:
    args, path, llm = adapter_bench(__doc__, NUM_REQUESTS)
    runs = {name: generate_run(llm, args.gen_len, loras) for name, loras in batches(path).items()}
    report_vs_plain(
        "lora_scale_mix", runs, NUM_REQUESTS, args.prompt_len, args.gen_len, args.dtype, VOCAB_SIZE
    )


if __name__ == "__main__":
    main()
