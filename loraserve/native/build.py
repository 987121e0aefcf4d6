"""Builds and loads the package's C kernels: compiled on first use for this CPU, loaded via ctypes.

Each kernel's C source ships with the package and is compiled with the system C compiler into
`<cache_root>/kernels/` the first time it is needed (well under a second: no torch headers), with
`-march=native`, so the compiler's own feature macros (`__AVX2__`, `__AVX512F__`, `__AVX512BF16__`,
...) pick the code paths this CPU runs: that is the runtime dispatch on CPU flags. The file name
carries a digest of the source, the flags and this CPU's feature flags, so a cache shared between
machines never runs code built for another CPU. No compiler or a failed build returns None and the
caller keeps its torch twin.

The sources live in `loraserve/native/kernels/` (the kernel room). Every kernel includes `simd.h` (the
room's shared SIMD vocabulary): it is compiled next to a copy
of it, and the header's bytes are part of every kernel's digest, so a changed header rebuilds them all.
A kernel split into parts keeps them beside its source as `<stem>_*.h` (`paged_attention_scores.h`
for `paged_attention.c`): they are copied beside it too and are part of that kernel's digest.

LORASERVE_CPU_KERNEL_ARCH replaces `native` in `-march=` (e.g. `haswell` for the AVX2 paths,
`x86-64` for the portable C): the tests use it to run every path on one machine.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from importlib import resources
from typing import Any

from loraserve import envs

logger = logging.getLogger(__name__)

FLAGS = ("-O3", "-fopenmp", "-shared", "-fPIC")
KERNELS = "loraserve.native.kernels"  # the package holding every kernel's source
HEADERS = ("simd.h", "side_stream.h")  # in KERNELS; every kernel may include them


def function_address(fn: Any) -> int:
    """The address of a loaded C function (a ctypes function object), for a kernel that calls another
    kernel through a function pointer; the library must stay loaded (ours stay for the process)."""
    return int(ctypes.cast(fn, ctypes.c_void_p).value or 0)


@functools.cache
def cpu_flags() -> frozenset[str]:
    """This CPU's feature flags as /proc/cpuinfo names them (e.g. 'avx2', 'avx512_bf16', 'amx_bf16')."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((line for line in f if line.startswith(("flags", "Features"))), "")
    except OSError:
        line = platform.processor()
    return frozenset(line.partition(":")[2].split())


def _headers() -> tuple[tuple[str, bytes], ...]:
    """The shared headers' (name, bytes), read at each load: an edited header is a new digest at once."""
    return tuple((name, resources.files(KERNELS).joinpath(name).read_bytes()) for name in HEADERS)


def _kernel_parts(package: str, stem: str) -> tuple[tuple[str, bytes], ...]:
    """The (name, bytes) of the kernel's own headers, `<stem>_*.h` beside its source, read at each load."""
    files = resources.files(package)
    names = sorted(f.name for f in files.iterdir() if f.name.startswith(stem + "_") and f.name.endswith(".h"))
    return tuple((name, files.joinpath(name).read_bytes()) for name in names)


def _build(
    compiler: str,
    flags: tuple[str, ...],
    source: tuple[str, bytes],
    headers: tuple[tuple[str, bytes], ...],
    target: str,
) -> None:
    os.makedirs(os.path.dirname(target), exist_ok=True)
    name = source[0]
    with tempfile.TemporaryDirectory(dir=os.path.dirname(target)) as tmp:
        # `#include "simd.h"` looks next to the source first: the headers go beside it
        for file_name, data in (source, *headers):
            with open(os.path.join(tmp, file_name), "wb") as f:
                f.write(data)
        src = os.path.join(tmp, name)
        out = os.path.join(tmp, "kernel.so")
        subprocess.run(
            [compiler, *flags, "-o", out, src, "-lm"], check=True, capture_output=True, timeout=120
        )
        os.replace(out, target)  # atomic: concurrent builders never load a half-written library


def load_library(
    source_name: str, arch: str | None = None, extra_flags: tuple[str, ...] = (), package: str = KERNELS
) -> ctypes.CDLL | None:
    """The compiled `source_name` (a C file in the kernel room, or in `package`), built if this CPU has
    no build yet;
    None when there is no compiler or the build fails (logged once per call). `arch` is the `-march=`
    value (default: LORASERVE_CPU_KERNEL_ARCH, else `native`) and `extra_flags` go last: tests build
    another CPU class's code paths with them (`arch="haswell"`, or "-mno-avx512f" for an AVX2 path).
    """
    flags = (*FLAGS, f"-march={arch or envs.cpu_kernel_arch()}", *extra_flags)
    compiler = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if compiler is None:
        logger.info("no C compiler found: %s runs on its torch twin", source_name)
        return None
    source = resources.files(package).joinpath(source_name).read_bytes()
    stem = source_name.rsplit(".", 1)[0]
    headers = _headers() + _kernel_parts(package, stem)
    parts = [
        source,
        *(data for _, data in headers),
        " ".join(flags).encode(),
        " ".join(sorted(cpu_flags())).encode(),
        platform.machine().encode(),
    ]
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:16]
    target = os.path.join(envs.cache_root(), "kernels", f"{stem}_{key}.so")
    try:
        if not os.path.exists(target):
            _build(compiler, flags, (source_name, source), headers, target)
        return ctypes.CDLL(target)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", b"") or b""
        logger.warning("C kernel %s unavailable (%s %s); using its torch twin", source_name, e, detail[-500:])
        return None
