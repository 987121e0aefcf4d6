"""This machine's memory read bandwidth, measured inside a benchmark's own run: the floor that a
memory-bound step (long-context decode attention reading its KV once) is held to.

The probe sums a float32 buffer of at least twice the last-level cache (this Xeon's L3 is 480 MiB, so
the usual 512 MiB probe would partly be served by it), best of `repeats`: the rate one full pass of
torch's vectorized reduction reads memory at, on the threads torch uses.
"""

from __future__ import annotations

import glob
import time

import torch

from loraserve.native import huge_pages

DEFAULT_LLC_BYTES = 64 << 20


def llc_bytes() -> int:
    """Bytes of the largest cache level cpu0 reports (sysfs), DEFAULT_LLC_BYTES where none does."""
    sizes = []
    for path in glob.glob("/sys/devices/system/cpu/cpu0/cache/index*/size"):
        try:
            with open(path, encoding="ascii") as f:
                text = f.read().strip()
        except OSError:
            continue
        scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(text[-1:], 1)
        digits = text[:-1] if scale > 1 else text
        if digits.isdigit():
            sizes.append(int(digits) * scale)
    return max(sizes, default=DEFAULT_LLC_BYTES)


def probe_buffer(min_bytes: int = 1 << 30) -> torch.Tensor:
    """A float32 buffer of max(min_bytes, 2 x LLC) bytes, touched once: what `read_once_gbs` reads. It
    lies on transparent huge pages where the kernel offers them, as the served weights do
    (`native.huge_pages`): on 4 KiB pages the stream prefetchers stop at every page, and the probe read
    24 GB/s on one Zen 4 thread (family 25 model 17) where the same sum over huge pages read 29."""
    (data,) = huge_pages.zeros([((max(min_bytes, 2 * llc_bytes()) // 4,), torch.float32)], "cpu")
    data.fill_(1.0)
    data.sum()  # first touch and warm-up
    return data


def read_once_gbs(data: torch.Tensor) -> float:
    """GB/s of one sum over `data` (a benchmark interleaves these with its steps: both see one load)."""
    start = time.perf_counter()
    data.sum()
    return data.numel() * data.element_size() / (time.perf_counter() - start) / 1e9


def read_bandwidth_gbs(repeats: int = 5, min_bytes: int = 1 << 30) -> float:
    """GB/s of the fastest of `repeats` sums over a `probe_buffer`."""
    data = probe_buffer(min_bytes)
    return max(read_once_gbs(data) for _ in range(repeats))
