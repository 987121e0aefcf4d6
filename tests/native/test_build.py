"""The C-kernel builder with the shared SIMD header: a kernel of any package compiles against
`native/simd.h`, the header picks the vector width the -march asks for, and the header is part of
every kernel's cache key (a changed header rebuilds)."""

from __future__ import annotations

import ctypes
import os
import platform
import shutil
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from loraserve.native import build

PROBE = b"""
#include "simd.h"
int probe_lanes(void) { return W; }
float probe_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }
int probe_extra(void) {
#ifdef PROBE_EXTRA
    return PROBE_EXTRA;
#else
    return 0;
#endif
}
"""


@pytest.fixture
def probe_package(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    """A package outside loraserve holding one C file that includes the shared header."""
    name = f"simd_probe_{os.getpid()}_{abs(hash(str(tmp_path))) % 10**8}"
    package = tmp_path / "src" / name
    package.mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "probe.c").write_bytes(PROBE)
    monkeypatch.syspath_prepend(str(tmp_path / "src"))
    monkeypatch.setenv("LORASERVE_CACHE_ROOT", str(tmp_path / "cache"))
    yield name
    sys.modules.pop(name, None)


def _load(package: str, arch: str | None = None) -> ctypes.CDLL:
    if not (os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")):
        pytest.skip("no C compiler")
    lib = build.load_library("probe.c", arch=arch, package=package)
    assert lib is not None, "the probe did not build (is the header beside it?)"
    lib.probe_round.argtypes, lib.probe_round.restype = [ctypes.c_float], ctypes.c_float
    return lib


def _built(tmp_path: Path) -> list[str]:
    return sorted(os.listdir(tmp_path / "cache" / "kernels"))


def test_a_kernel_outside_the_package_compiles_against_the_header(probe_package: str) -> None:
    lib = _load(probe_package)
    flags = build.cpu_flags()
    expected = 16 if {"avx512f", "avx512bw", "avx512vl"} <= flags else 8 if {"avx2", "fma"} <= flags else 1
    if platform.machine() not in ("x86_64", "AMD64"):
        expected = 1
    assert lib.probe_lanes() == expected
    # to nearest, ties to even: 1 + 2^-8 is halfway between 1 and 1 + 2^-7
    assert lib.probe_round(1.0 + 2.0**-8) == 1.0
    assert lib.probe_round(1.0 + 3 * 2.0**-8) == 1.0 + 2 * 2.0**-7
    assert lib.probe_round(float("nan")) != lib.probe_round(float("nan"))  # stays NaN, not inf


@pytest.mark.parametrize(("arch", "lanes", "needs"), [("haswell", 8, {"avx2", "fma"}), ("x86-64", 1, set())])
def test_the_header_follows_the_arch(probe_package: str, arch: str, lanes: int, needs: set[str]) -> None:
    if platform.machine() not in ("x86_64", "AMD64") or not needs <= build.cpu_flags():
        pytest.skip(f"-march={arch} needs an x86-64 CPU with {sorted(needs)}")
    assert _load(probe_package, arch).probe_lanes() == lanes


def test_a_changed_header_rebuilds_every_kernel(
    probe_package: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    assert _load(probe_package).probe_extra() == 0
    first = _built(tmp_path)
    assert len(first) == 1
    assert _load(probe_package).probe_extra() == 0 and _built(tmp_path) == first  # unchanged: cached

    headers = build._headers()
    changed = tuple((name, data + b"\n#define PROBE_EXTRA 7\n") for name, data in headers)
    monkeypatch.setattr(build, "_headers", lambda: changed)
    assert _load(probe_package).probe_extra() == 7
    assert len(_built(tmp_path)) == 2  # a new digest, a new library beside the old one


def test_the_headers_ship_with_the_package() -> None:
    """What an installed (non-editable) loraserve reads: the shared headers as package resources."""
    names = dict(build._headers())
    assert set(names) == {"simd.h", "side_stream.h"} and b"#define W 16" in names["simd.h"]
    assert b"side_fetch" in names["side_stream.h"]


def test_a_kernel_split_into_parts_compiles_with_them_and_rebuilds_when_one_changes(
    probe_package: str, tmp_path: Path
) -> None:
    """A kernel's own `<stem>_*.h` beside its source (paged_attention.c's parts) are copied into the
    build and are part of its digest; a header of another stem is neither."""
    package = tmp_path / "src" / probe_package
    (package / "probe.c").write_bytes(
        PROBE.replace(b'#include "simd.h"', b'#include "simd.h"\n#include "probe_part.h"')
    )
    (package / "probe_part.h").write_bytes(b"#define PROBE_EXTRA 3\n")
    (package / "other_part.h").write_bytes(b"#error not this one\n")
    assert _load(probe_package).probe_extra() == 3
    first = _built(tmp_path)
    (package / "other_part.h").write_bytes(b"#error still not this one\n")
    assert _load(probe_package).probe_extra() == 3 and _built(tmp_path) == first  # not its part: cached
    (package / "probe_part.h").write_bytes(b"#define PROBE_EXTRA 5\n")
    assert _load(probe_package).probe_extra() == 5
    assert len(_built(tmp_path)) == 2


def test_the_attention_kernels_parts_ship_with_the_package() -> None:
    names = [name for name, _ in build._kernel_parts(build.KERNELS, "paged_attention")]
    assert "paged_attention_scores.h" in names and all(n.startswith("paged_attention_") for n in names)
