"""The fused float32 CPU LoRA kernel (`cpu_kernel.c`): built on first use, called through ctypes.

Built for this CPU on first use by `loraserve.native.build`. No compiler, a failed build, or
LORASERVE_CPU_LORA_KERNEL=0 leaves the torch ops in charge; the result is the same either way.

The kernel beats torch's bmm on short segments (decode) and loses on long ones (prefill is
compute-bound, where MKL wins; measurements in benchmarks/README.md), so `applies` sends it only
steps whose segments are at most MAX_SEGMENT_LEN tokens long.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from array import array
from typing import Any

import torch

from loraserve import envs
from loraserve.lora.mapping import LoRABatchMapping
from loraserve.native.build import load_library

logger = logging.getLogger(__name__)

MAX_SEGMENT_LEN = 32  # longest per-slot token segment the kernel beats the bmm path on (see above)
_lock = threading.Lock()
_kernel: Any = None  # lora_fused_f32, once loaded
_write_kernel: Any = None  # lora_write_blocks, once loaded
_loaded = False


def _load() -> Any:
    lib = load_library("loraserve.lora.ops", "cpu_kernel.c")
    if lib is None:
        return None
    try:
        fused, write = lib.lora_fused_f32, lib.lora_write_blocks
    except AttributeError as e:
        logger.warning("CPU LoRA kernel unavailable (%s); using the torch ops", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fused.restype = ctypes.c_int
    fused.argtypes = [ptr, i64, ptr, i64, i64, i64, ptr, ptr, i64, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i64,
                      ctypes.c_int]
    write.restype = None
    write.argtypes = [i64, ptr, ptr, ctypes.c_int]
    return fused, write


def kernel_available() -> bool:
    """Builds (once per process) and loads the kernels; False if disabled or they cannot be built."""
    global _kernel, _write_kernel, _loaded
    if not envs.cpu_lora_kernel():
        return False
    with _lock:
        if not _loaded:
            loaded = _load()
            _kernel, _write_kernel = loaded if loaded is not None else (None, None)
            _loaded = True
    return _kernel is not None


def write_kernel_available() -> bool:
    """Whether `write_blocks` runs in C (same build and switch as the fused kernel)."""
    return kernel_available() and _write_kernel is not None


def write_blocks(records: array, scales: array) -> None:
    """Run the slot writes `records` (7 int64 per block; see cpu_kernel.c) with their `scales`."""
    if len(records) != 7 * len(scales) or records.typecode != "q" or scales.typecode != "f":
        raise ValueError("write_blocks needs 7 int64 values and one float32 scale per block")
    assert _write_kernel is not None
    records_ptr, _ = records.buffer_info()
    scales_ptr, _ = scales.buffer_info()
    _write_kernel(len(scales), records_ptr, scales_ptr, torch.get_num_threads())


def layer_args(
    a: torch.Tensor, b_t: torch.Tensor, slice_offsets: torch.Tensor, ranks: torch.Tensor, max_rank: int
) -> tuple[int, ...] | None:
    """The per-layer half of the kernel's arguments (plus the slot count, last), or None when the kernel
    cannot serve these buffers (not float32 contiguous CPU tensors, or no kernel). The kernel reads the
    buffers and `ranks` through raw pointers: they must stay alive and in place while the args are used.

    a [L, n*R, in]; b_t [L, n*R, out]; slice_offsets [n + 1] int64; ranks [L, n] int32; max_rank R.
    Raises ValueError for slice offsets that do not cut the outputs."""
    tensors = (a, b_t, slice_offsets, ranks)
    if a.dtype != torch.float32 or b_t.dtype != torch.float32 or any(t.device.type != "cpu" for t in tensors):
        return None
    num_slices, stacked = slice_offsets.shape[0] - 1, a.shape[1]
    if not all(t.is_contiguous() for t in tensors) or b_t.shape[:2] != a.shape[:2] \
            or stacked != num_slices * max_rank or ranks.shape != (a.shape[0], num_slices) \
            or ranks.dtype != torch.int32 or slice_offsets.dtype != torch.int64:
        return None
    offsets = slice_offsets.tolist()
    if offsets[0] != 0 or offsets[-1] != b_t.shape[2] or any(x >= y for x, y in zip(offsets, offsets[1:])):
        raise ValueError(f"slice offsets {offsets} do not cut the {b_t.shape[2]} outputs into slices")
    if not kernel_available():
        return None
    return (a.shape[2], b_t.shape[2], a.data_ptr(), b_t.data_ptr(), max_rank, num_slices,
            slice_offsets.data_ptr(), ranks.data_ptr(), a.shape[0])


def applies(x: torch.Tensor, y: torch.Tensor, mapping: LoRABatchMapping) -> bool:
    """Whether the kernel serves this step for x/y (given buffers whose `layer_args` are set)."""
    return (
        mapping.cpu_kernel_args is not None
        and mapping.segments.max_len <= MAX_SEGMENT_LEN
        and x.dtype == torch.float32 and y.dtype == torch.float32
        and x.device.type == "cpu" and y.device.type == "cpu"
        and x.dim() == 2 and y.dim() == 2 and x.stride(1) == 1 and y.stride(1) == 1
    )


def run(x: torch.Tensor, y: torch.Tensor, args: tuple[int, ...], mapping: LoRABatchMapping) -> torch.Tensor:
    """y[i] += Bt[s_i]^T A[s_i] x[i], slice by slice over each slot's ranks, for tokens with slot
    s_i >= 0; `args` from `layer_args`; call only when `applies`. Row i reads only slot s_i's blocks
    (a NaN slot reaches only its own tokens); rows of slot -1 are left alone. Same result as
    `torch_ops.add_lora` up to float summation order.

    x [T, in]; y [T, out], updated in place and returned."""
    assert mapping.cpu_kernel_args is not None and _kernel is not None
    if x.shape[0] != mapping.num_tokens or y.shape[0] != mapping.num_tokens or (x.shape[1], y.shape[1]) != args[:2]:
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} do not fit {mapping.num_tokens} tokens "
                         f"and a layer of in={args[0]}, out={args[1]}")
    if mapping.active_slots and mapping.active_slots[-1] >= args[-1]:
        raise ValueError(f"slot {mapping.active_slots[-1]} is out of range for a layer of {args[-1]} slots")
    status = _kernel(x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0), *args[:-1], *mapping.cpu_kernel_args,
                     torch.get_num_threads())
    if status != 0:
        raise MemoryError("CPU LoRA kernel could not allocate its scratch buffer")
    return y
