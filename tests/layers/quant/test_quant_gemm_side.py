"""quant_gemm's side stream (the decoder stack's LoRA prefetch, native/kernels/side_stream.h): fetching
other memory while the quantized product runs changes no output bit, whatever the runs, their split
among threads, or a side list the kernel must ignore."""

from __future__ import annotations

import ctypes
from typing import Any

import pytest
import torch
from support.quant_blocks import random_quant_tensor

from loraserve.layers.quant import kernel as qk
from loraserve.layers.quant.formats import QUANT_TYPES

_GEMM = ctypes.CFUNCTYPE(
    ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_void_p,
    ctypes.c_int64, ctypes.c_int, ctypes.c_void_p,
)  # fmt: skip


def _side(base: int, runs: list[tuple[int, int, int, int]], split: int) -> Any:
    flat = [v for address, *rest in runs for v in (base + address, *rest)]
    return (ctypes.c_int64 * (2 + len(flat)))(len(runs), split, *flat)


@pytest.mark.parametrize("num_threads", [1, 2, 3])
@pytest.mark.parametrize("rows", [1, 9])
def test_side_fetch_changes_nothing(num_threads: int, rows: int) -> None:
    if qk.kernel_library() is None:
        pytest.skip("no C compiler")
    parts = [qk.prepare(random_quant_tensor(QUANT_TYPES[name], 48, 512, seed=i)) for i, name in
             enumerate(("Q4_1", "Q4_K", "Q8_0"))]  # fmt: skip
    address, args = qk.stack_binding(list(parts), torch.bfloat16)
    gemm = _GEMM(address)
    x = torch.randn(rows, 512, generator=torch.Generator().manual_seed(rows)).to(torch.bfloat16)

    def run(side: Any) -> torch.Tensor:
        y = torch.empty(rows, 144, dtype=torch.bfloat16)
        assert gemm(args, x.data_ptr(), x.stride(0), None, y.data_ptr(), rows, num_threads, side) == 0
        return y

    want = run(None)
    memory = torch.zeros(1 << 20, dtype=torch.uint8)
    base = memory.data_ptr()
    for runs, split in (
        ([(7, 130, 1, 0), (300, 64, 5, 1000), (9000, 0, 3, 64), (20000, 100, 0, 0)], 0),  # empty runs too
        ([(i * 9000 + 3, 500, 16, 560) for i in range(8)], 2),  # 4 segments of 2 runs, split among threads
        ([(i * 9000, 64, 2, 128) for i in range(6)], 1),  # more segments than threads, or fewer
        ([(0, 1 << 19, 1, 0), (1 << 19, 1 << 18, 2, 1 << 18)], 0),  # more lines than the product's items
        ([(0, 64, 1, 0)] * 3, 2),  # 3 runs in segments of 2: malformed, ignored
    ):
        assert torch.equal(run(_side(base, runs, split)), want), (runs, split)
