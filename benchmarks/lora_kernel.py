"""The fused C LoRA kernel against the torch ops, per step of a SmolLM-135M-shaped model.

30 layers x 4 LoRA layers (qkv, o, gate_up, down: the 7 projections), rank 16 in all 16 slots; one
"step" is the LoRA term of every layer, computed by `lora_cpu.run` (the kernel, whatever
max_segment_len says) or `lora_torch.add_lora` (the layout the mapping picks). Best of --repeats.
Usage: python -m benchmarks.lora_kernel [--dtype bfloat16] [--repeats 9] [--sweep]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from benchmarks.common import cpu_class
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.lora.ops import LoRABuffers, lora_cpu, lora_torch

HIDDEN, INTERMEDIATE, KV, LAYERS, RANK, SLOTS = 576, 1536, 192, 30, 16, 16
# (in_features, slice sizes) of each LoRA layer of one transformer layer.
MODULES = [(HIDDEN, [HIDDEN, KV, KV]), (HIDDEN, [HIDDEN]), (HIDDEN, [INTERMEDIATE] * 2), (INTERMEDIATE, [HIDDEN])]
MIXES = {  # name: (adapters, tokens per adapter)
    "16 adapters x 2 tokens (decode)": (16, 2),
    "16 adapters x 4 tokens": (16, 4),
    "1 adapter x 32 tokens": (1, 32),
    "16 adapters x 64 tokens (prefill)": (16, 64),
}
SWEEP = {f"16 adapters x {n} tokens": (16, n) for n in (8, 16, 24, 32, 40, 48)} | {
    f"1 adapter x {n} tokens": (1, n) for n in (64, 128)}


def build_layers(dtype: torch.dtype) -> list[LoRABuffers]:
    g = torch.Generator().manual_seed(0)
    layers = []
    for _ in range(LAYERS):
        for in_features, sizes in MODULES:
            offsets = [0, *torch.tensor(sizes).cumsum(0).tolist()]
            buffers = LoRABuffers.allocate(SLOTS, RANK, in_features, offsets, dtype, torch.device("cpu"), False)
            buffers.lora_a.copy_(torch.randn(buffers.lora_a.shape, generator=g) * 0.05)
            buffers.lora_b_t.copy_(torch.randn(buffers.lora_b_t.shape, generator=g) * 0.05)
            buffers.ranks.fill_(RANK)
            buffers.active_mask = (1 << SLOTS) - 1
            layers.append(buffers)
    return layers


def best_ms(fn: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * min(times)


def measure(layers: list[LoRABuffers], dtype: torch.dtype, adapters: int, per_adapter: int,
            repeats: int) -> tuple[float, float]:
    """(torch ms, kernel ms) for one step of `adapters` x `per_adapter` tokens, sorted by slot."""
    slots = [s for s in range(adapters) for _ in range(per_adapter)]
    mapping = LoRABatchMapping.build(slots, "cpu", max_loras=SLOTS)
    inputs = {n: torch.randn(len(slots), n).to(dtype) for n in (HIDDEN, INTERMEDIATE)}
    outputs = {b.lora_b_t.shape[2]: torch.zeros(len(slots), b.lora_b_t.shape[2], dtype=dtype) for b in layers}

    def torch_step() -> None:
        for b in layers:
            lora_torch.add_lora(outputs[b.lora_b_t.shape[2]], inputs[b.lora_a.shape[2]], b.lora_a, b.lora_b, mapping)

    def kernel_step() -> None:
        for b in layers:
            assert b.cpu_kernel_args is not None
            lora_cpu.run(inputs[b.lora_a.shape[2]], outputs[b.lora_b_t.shape[2]], b.cpu_kernel_args, mapping)

    return best_ms(torch_step, repeats), best_ms(kernel_step, repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--sweep", action="store_true", help="segment lengths around the crossover instead")
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if not lora_cpu.kernel_available():
        raise SystemExit("the C kernel is not available here (no compiler, or LORASERVE_CPU_LORA_KERNEL=0)")
    build = lora_cpu.kernel_build()
    assert build is not None
    print(f"{cpu_class()}, {args.dtype}, "
          f"kernel code paths: {', '.join(sorted(build.code_paths)) or 'C'}")
    with torch.inference_mode():
        layers = build_layers(dtype)
        for name, (adapters, per_adapter) in (SWEEP if args.sweep else MIXES).items():
            torch_ms, kernel_ms = measure(layers, dtype, adapters, per_adapter, args.repeats)
            print(f"    {name:36s} torch {torch_ms:7.1f} ms   kernel {kernel_ms:7.1f} ms")


if __name__ == "__main__":
    main()
