"""The compute bound the many-row benchmark rows are printed beside: the int8 multiply-add probe and the
multiply-adds a GGUF model's linears cost a token."""

from __future__ import annotations

import ctypes
import platform

import pytest
from support.gguf_files import FFN, HIDDEN, NUM_HEADS, NUM_KV_HEADS, NUM_LAYERS, write_tiny_llama_gguf

from benchmarks.int8_peak import int8_peak_gmacs, linear_macs
from loraserve.native.build import cpu_flags, load_library


def test_linear_macs_are_the_layers_linears_and_the_head(tmp_path) -> None:
    path = write_tiny_llama_gguf(str(tmp_path / "tiny.gguf"))
    layers, head = linear_macs(path)
    kv = NUM_KV_HEADS * HIDDEN // NUM_HEADS
    assert layers == NUM_LAYERS * (2 * HIDDEN * HIDDEN + 2 * kv * HIDDEN + 3 * FFN * HIDDEN)
    assert head > 0 and head % HIDDEN == 0  # the output weight: vocabulary x hidden


def test_the_probe_counts_what_it_ran() -> None:
    if platform.machine() not in ("x86_64", "AMD64") or "avx2" not in cpu_flags():
        pytest.skip("the probe's vector int8 product needs AVX2 or AVX512-VNNI")
    lib = load_library("int8_peak.c", package="benchmarks")
    if lib is None:
        pytest.skip("no C compiler")
    lib.int8_peak.restype = ctypes.c_int64
    sink = ctypes.c_int32()
    per = 64 if {"avx512f", "avx512_vnni"} <= cpu_flags() else 32  # byte products per instruction
    assert lib.int8_peak(ctypes.c_int64(100), 2, ctypes.byref(sink)) == per * 10 * 100 * 2  # 10 chains
    peak = int8_peak_gmacs(1, repeats=1, seconds=0.01)
    assert peak is not None and peak > 0
