"""Long-lived CPU buffers in anonymous mappings: on transparent huge pages for the packed weights (dense
and quantized) and the LoRA slots, on plain lazily committed pages for the KV cache.

A decode step streams every packed weight and the slot rows of every adapter in the batch from
memory. On 4 KiB pages that is a TLB entry per 4 KiB (about 40k page walks a step for a 135M model
with 16 adapters), and the hardware prefetchers stop at every page boundary. `zeros(specs)` carves
all of a group's tensors from one anonymous mapping advised MADV_HUGEPAGE before its first touch, so
the kernel backs it with 2 MiB pages where it has them (Linux THP in `madvise` or `always` mode).
That made a many-adapter step faster and left the base model unchanged (benchmarks/README.md). The
KV cache stays on plain pages: its blocks are first touched while serving, and huge-page faults there
made prefill slower, while prefaulting the whole cache bought nothing measurable. It takes
`zeros(specs, huge=False)`: a mapping the kernel zero-fills page by page on first write, so an engine
starts without writing its whole cache (`torch.zeros` wrote the 1 GiB default: 0.45 s, most of a tiny
model's start) and RSS grows with the blocks sequences use. Elsewhere (THP off, not Linux,
LORASERVE_CPU_HUGE_PAGES=0) huge-page tensors are plain `torch.zeros`: nothing else changes.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import math
import mmap
from collections.abc import Sequence

import torch

from loraserve import envs

logger = logging.getLogger(__name__)
HUGE_PAGE = 2 << 20
ALIGN = 64  # every tensor starts on a cache line

Spec = tuple[tuple[int, ...], torch.dtype]


def zeros(
    specs: Sequence[Spec], device: torch.device | str, touch: bool = False, huge: bool = True
) -> list[torch.Tensor]:
    """Zero-filled contiguous tensors of these (shape, dtype), on huge pages where possible (CPU), or
    with `huge=False` on plain pages, committed as they are first written.

    They share one mapping, which lives as long as any of them holds a slice of it (a memoryview: the
    mapping cannot be closed while one exists), so no tensor can outlive its memory. `touch` faults
    every page in now, for memory first written while serving: a huge page's first fault zeroes 2 MiB
    (and may compact memory to find one), which would otherwise land on a request."""
    offered = not huge or (envs.cpu_huge_pages() and hasattr(mmap, "MADV_HUGEPAGE"))
    if torch.device(device).type != "cpu" or not offered:
        return [torch.zeros(shape, dtype=dtype, device=device) for shape, dtype in specs]
    sizes = [math.prod(shape) * torch.empty((), dtype=dtype).element_size() for shape, dtype in specs]
    offsets, total = [], 0
    for size in sizes:
        offsets.append(total)
        total += -(-size // ALIGN) * ALIGN
    if total == 0:
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]
    try:
        mapping = mmap.mmap(-1, total + (HUGE_PAGE if huge else 0), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        if huge:
            mapping.madvise(mmap.MADV_HUGEPAGE)
    except (OSError, ValueError) as e:  # no room for the mapping, or THP not offered: plain memory
        logger.info("no anonymous mapping%s (%s): plain allocations", " on huge pages" if huge else "", e)
        return [torch.zeros(shape, dtype=dtype) for shape, dtype in specs]
    memory = memoryview(mapping)  # each tensor's buffer is a slice of it: the mapping cannot close under them
    start = -torch.frombuffer(memory, dtype=torch.uint8).data_ptr() % HUGE_PAGE if huge else 0  # whole pages after it
    if touch:
        torch.frombuffer(memory[start : start + total], dtype=torch.uint8).zero_()
    # One storage per tensor (a slice of its own), not views of one arena: saving, pickling or sharing
    # one of them then moves its own bytes only, and it alone keeps its pages resident.
    return [
        _carve(memory[start + offset : start + offset + size], shape, dtype)
        if size
        else torch.zeros(shape, dtype=dtype)
        for offset, size, (shape, dtype) in zip(offsets, sizes, specs, strict=True)
    ]


def _carve(memory: memoryview, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    return torch.frombuffer(memory, dtype=torch.uint8).view(dtype).view(shape)


def trim_heap() -> None:
    """Give the C heap's free memory back to the system (glibc's `malloc_trim`; elsewhere nothing).
    A load's temporaries (a file's blocks, repacked copies, each up to tens of MB) come from glibc's
    heap once its mmap threshold has risen past them, and free() keeps them there: after a 1B Q4_K_M
    file had loaded, 820 MB of freed memory still counted in RSS, which the trim returned (Zen 3 box)."""
    name = ctypes.util.find_library("c")
    if name is None:
        return
    try:
        trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    except OSError:
        return
    if trim is not None:
        trim(0)
