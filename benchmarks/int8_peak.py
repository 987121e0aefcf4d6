"""This machine's int8 multiply-add peak, measured inside a benchmark's own run (`int8_peak.c`): the
ceiling a compute-bound quantized product (prompt processing, decode steps of many rows) is held to,
as the read bandwidth (`bandwidth.py`) is a one-row decode step's.

A byte product is one multiply-add; the peak is the widest int8 instruction this build runs
(AVX512-VNNI's 512-bit vpdpbusd, else AVX2's vpmaddubsw with the add that accumulates it), all threads
at once, best of `repeats`.
"""

from __future__ import annotations

import ctypes
import time

from loraserve.native.build import load_library


def int8_peak_gmacs(threads: int, repeats: int = 9, seconds: float = 0.2) -> float | None:
    """G multiply-adds a second of `threads` threads, or None without a compiler or an int8 vector product."""
    lib = load_library("int8_peak.c", package="benchmarks")
    if lib is None:
        return None
    lib.int8_peak.restype = ctypes.c_int64
    lib.int8_peak.argtypes = (ctypes.c_int64, ctypes.c_int, ctypes.POINTER(ctypes.c_int32))
    sink = ctypes.c_int32()
    iters = 1 << 14
    while True:  # grow a pass to about `seconds`
        start = time.perf_counter()
        if lib.int8_peak(iters, threads, ctypes.byref(sink)) == 0:
            return None
        if time.perf_counter() - start >= seconds / 4:
            break
        iters *= 4
    best = 0.0
    for _ in range(repeats):
        start = time.perf_counter()
        macs = lib.int8_peak(iters, threads, ctypes.byref(sink))
        best = max(best, macs / (time.perf_counter() - start) / 1e9)
    return best


def linear_macs(path: str) -> tuple[int, int]:
    """(multiply-adds a token costs in a GGUF model's decoder layers' linears, those of its LM head: the
    output weight, else the tied token embedding), read from the file's tensor shapes."""
    from gguf import GGUFReader

    tensors = {t.name: int(t.n_elements) for t in GGUFReader(path).tensors if len(t.shape) == 2}
    layers = sum(n for name, n in tensors.items() if name.startswith("blk."))
    return layers, tensors.get("output.weight", tensors.get("token_embd.weight", 0))


if __name__ == "__main__":
    import sys

    for t in map(int, sys.argv[1:] or ["1"]):
        print(f"{t} thread(s): {int8_peak_gmacs(t)} G int8 multiply-adds a second")
