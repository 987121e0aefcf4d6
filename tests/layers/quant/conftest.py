"""The quantized kernel's builds (quant_kernel.c) this machine can run, as a fixture: each test that
takes `build` runs once per build with it swapped in (layers/quant/kernel.use_library)."""

from __future__ import annotations

import platform
from collections.abc import Iterator

import pytest

from loraserve.layers.quant import kernel as qk
from loraserve.native.build import cpu_flags

# name: (flags after -march=native, CPU flags it needs, the path it must report)
BUILDS: dict[str, tuple[tuple[str, ...], set[str], str]] = {
    "avx512_vnni": ((), {"avx512f", "avx512bw", "avx512vl", "avx512_vnni"}, "avx512_vnni"),
    "avx2": (("-mno-avx512f", "-mno-avxvnni"), {"avx2", "fma"}, "avx2"),
    "avx2_panels": (("-mno-avx512f", "-mno-avxvnni", "-DPANEL_MIN_ROWS=1"), {"avx2", "fma"}, "avx2"),
    "portable": (("-mno-avx",), set(), "portable"),
}


@pytest.fixture(params=list(BUILDS))
def build(request: pytest.FixtureRequest) -> Iterator[str]:
    flags, needs, path = BUILDS[request.param]
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= cpu_flags():
        pytest.skip(f"this build needs an x86-64 CPU with {sorted(needs)}")
    lib = qk.build_kernel(flags)
    if lib is None:
        pytest.skip("no C compiler: the kernel is not built here")
    own = qk.kernel_library()
    qk.use_library(lib)
    assert qk.kernel_path() == path
    yield request.param
    qk.use_library(own)
