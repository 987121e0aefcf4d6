"""HeapTrimmer: trims at most once per interval (a fake clock decides), and is present on glibc Linux."""

from __future__ import annotations

import platform

import pytest

from loraserve.engine.heap_trim import HeapTrimmer


def test_trims_at_most_once_per_interval() -> None:
    now = [100.0]
    trimmer = HeapTrimmer(interval_s=10.0, clock=lambda: now[0])
    if not trimmer.is_available:
        pytest.skip("no malloc_trim in this C library")
    assert not trimmer.maybe_trim()  # the interval starts when the trimmer is made
    now[0] = 109.9
    assert not trimmer.maybe_trim()
    now[0] = 110.0
    assert trimmer.maybe_trim() and trimmer.num_trims == 1
    now[0] = 115.0
    assert not trimmer.maybe_trim()
    now[0] = 121.0
    assert trimmer.maybe_trim() and trimmer.num_trims == 2


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_available_on_glibc() -> None:
    assert HeapTrimmer().is_available
