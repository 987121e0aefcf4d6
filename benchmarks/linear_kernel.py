"""The C linear kernel (native/kernels/gemm_kernel.c) against oneDNN's packed linear, the path it replaces.

Per layer shape of a SmolLM-135M-shaped model and row count: one weight, called back to back (it stays
in the caches: the kernels' compute). Then a whole step: 30 layers' distinct weights and the LM head,
as a decode step streams them from memory. Best of --repeats.
Usage: python -m benchmarks.linear_kernel [--dtype bfloat16] [--rows 16,32,64,256,2048] [--repeats 7]
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable

import torch

from benchmarks.common import cpu_class
from loraserve.layers import gemm_cpu

HIDDEN, INTERMEDIATE, QKV, LAYERS, VOCAB = 576, 1536, 960, 30, 49152
SHAPES = [(HIDDEN, QKV), (HIDDEN, HIDDEN), (HIDDEN, 2 * INTERMEDIATE), (INTERMEDIATE, HIDDEN)]  # (in, out)


def best_ms(fn: Callable[[], object], repeats: int, calls: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls)
    return best * 1e3


def _bound(fn: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor) -> Callable[[], torch.Tensor]:
    return lambda: fn(x)


def onednn(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = torch.ops.mkldnn._reorder_linear_weight(weight)
    return lambda x: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], "")


def ours(weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor]:
    packed = gemm_cpu.pack(weight)
    assert packed is not None
    return lambda x: gemm_cpu.linear(x, packed, None)


def per_shape(dtype: torch.dtype, rows: list[int], repeats: int) -> None:
    print(f"{'in':>6} {'out':>6} {'rows':>5} {'oneDNN ms':>10} {'kernel ms':>10} {'speed-up':>9} {'kernel GFLOP/s':>15}")
    for cols_in, cols_out in [*SHAPES, (HIDDEN, VOCAB)]:
        weight = torch.randn(cols_out, cols_in).to(dtype)
        paths = {"onednn": onednn(weight), "ours": ours(weight)}
        for m in rows:
            if cols_out == VOCAB and m > 64:
                continue  # the LM head only ever sees the step's last tokens
            x = torch.randn(m, cols_in).to(dtype)
            calls = max(1, int(2e8 / (m * cols_in * cols_out)))
            ms = {name: best_ms(_bound(f, x), repeats, calls) for name, f in paths.items()}
            flops = 2 * m * cols_in * cols_out / (ms["ours"] * 1e-3) / 1e9
            print(f"{cols_in:>6} {cols_out:>6} {m:>5} {ms['onednn']:>10.3f} {ms['ours']:>10.3f} "
                  f"{ms['onednn'] / ms['ours']:>8.2f}x {flops:>15.0f}")


def whole_step(dtype: torch.dtype, rows: list[int], repeats: int) -> None:
    print(f"\nA step's linears: {LAYERS} layers of distinct weights and the LM head (weights from memory)")
    weights = [torch.randn(o, i).to(dtype) for _ in range(LAYERS) for i, o in SHAPES]
    head = torch.randn(VOCAB, HIDDEN).to(dtype)
    packed = [gemm_cpu.pack(w) for w in [*weights, head]]
    gemm_cpu.chain_prefetch([p for p in packed if p is not None])  # as pack_cpu_linears does for a model
    kernel: list[Callable[[torch.Tensor], torch.Tensor]] = [
        lambda x, p=p: gemm_cpu.linear(x, p, None) for p in packed  # type: ignore[misc]
    ]
    dnn: list[Callable[[torch.Tensor], torch.Tensor]] = [onednn(w) for w in [*weights, head]]
    for name, every in (("oneDNN", dnn), ("kernel", kernel)):
        layers, lm_head = every[:-1], every[-1]
        cells = []
        for m in (r for r in rows if r <= 64):
            xs = {i: torch.randn(m, i).to(dtype) for i, _ in SHAPES}
            cells.append(f"{m} rows {best_ms(_step(layers, lm_head, xs), repeats, 1):.2f} ms")
        print(f"  {name:7s} " + "   ".join(cells))


def _step(layers: list[Callable[[torch.Tensor], torch.Tensor]], lm_head: Callable[[torch.Tensor], torch.Tensor],
          xs: dict[int, torch.Tensor]) -> Callable[[], None]:
    def step() -> None:
        for j, layer in enumerate(layers):
            layer(xs[SHAPES[j % 4][0]])
        lm_head(xs[HIDDEN])

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--rows", default="16,32,64,256,2048")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    dtype = getattr(torch, args.dtype)
    if gemm_cpu.block_layout(dtype) == 0:
        raise SystemExit(f"the C linear kernel does not serve {args.dtype} on this CPU (oneDNN runs it)")
    rows = [int(r) for r in args.rows.split(",")]
    print(f"{cpu_class()}, {args.dtype}")
    with torch.inference_mode():
        per_shape(dtype, rows, args.repeats)
        whole_step(dtype, rows, args.repeats)


if __name__ == "__main__":
    main()
