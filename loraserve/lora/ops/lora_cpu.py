"""The fused CPU LoRA kernel (`lora_kernel.c`, float32 and bfloat16): built on first use, called through ctypes.

Built for this CPU on first use by `loraserve.native.build`. No compiler, a failed build, or
LORASERVE_CPU_LORA_KERNEL=0 leaves the torch ops in charge; the result is the same either way.

`serves` is the one rule for when it runs a layer's LoRA term, asked by `ops.add_lora` and by the
decoder stack (`models/llama_stack.py`) alike: every step whose segments are at most
`max_segment_len(dtype)` tokens long, with
AVX-512 (bf16: AVX512-BF16) the kernel beat torch's batched matmuls at every length measured, 8 to
2048 tokens per adapter, with two threads; the AVX2 and plain AVX-512 bf16 paths lost to them past
128 (fp32) and 32 (bf16) tokens when last measured (benchmarks/README.md).
"""

from __future__ import annotations

import ctypes
import logging
from array import array
from dataclasses import dataclass
from typing import Any

import torch

from loraserve import envs
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.native.build import load_library
from loraserve.native.kernel_slot import KernelSlot

logger = logging.getLogger(__name__)

# Longest per-slot token segment the kernel takes, per dtype: (with the code path that beat torch up
# to it, length), (without it, length). See the module docstring.
_SEGMENT_LIMITS: dict[torch.dtype, tuple[str, int, int]] = {
    torch.float32: ("avx512", 2048, 128),
    torch.bfloat16: ("avx512_bf16", 2048, 32),
}
ELEM_TYPES = {torch.float32: 0, torch.bfloat16: 1}  # the kernel's LORA_F32 / LORA_BF16
RECORD_LEN = 8  # int64 values per `write_blocks` record
CODE_PATHS = ("avx2", "avx512", "avx512_bf16")  # bits 0, 1, 2 of lora_code_paths()


@dataclass(frozen=True, slots=True)
class KernelBuild:
    """One build of lora_kernel.c: its entry points and the vector code paths compiled into it."""

    fused: Any  # lora_fused
    write: Any  # lora_write_blocks
    weight_ranges: Any  # lora_weight_ranges
    code_paths: frozenset[str]  # of CODE_PATHS; empty: the portable C alone

    def t_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """What the build rounds t = A x to before the expand, for buffers of `dtype`: bfloat16 where its
        bf16 expand multiplies pairs of bf16 (AVX512-BF16), else float32 (t as summed)."""
        return torch.bfloat16 if dtype == torch.bfloat16 and "avx512_bf16" in self.code_paths else torch.float32


@dataclass(frozen=True, slots=True)
class LayerArgs:
    """One layer's half of the kernel's arguments: its buffers' dtype, sizes and raw pointers."""

    dtype: torch.dtype
    in_features: int
    out_features: int
    num_slots: int
    c_layer: ctypes.Array[ctypes.c_int64]  # the kernel's `layer` array (see lora_fused in lora_kernel.c)




def build_kernels(extra_flags: tuple[str, ...] = ()) -> KernelBuild | None:
    """A build of lora_kernel.c, or None when it cannot be built. `extra_flags` (see `load_library`)
    select another of its code paths: tests run them all on one CPU."""
    lib = load_library("lora_kernel.c", extra_flags=extra_flags)
    if lib is None:
        return None
    try:
        fused, write, paths, ranges = lib.lora_fused, lib.lora_write_blocks, lib.lora_code_paths, lib.lora_weight_ranges
    except AttributeError as e:
        logger.warning("CPU LoRA kernel unavailable (%s); using the torch ops", e)
        return None
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    fused.restype = ctypes.c_int
    fused.argtypes = [ptr, ptr, ptr, i64, ptr, i64, ctypes.c_int]
    write.restype = None
    write.argtypes = [i64, ptr, ptr, ctypes.c_int]
    paths.restype, paths.argtypes = ctypes.c_int, []
    bits = paths()
    ranges.restype = ctypes.c_int64
    ranges.argtypes = [ptr, ptr, ptr, i64, ctypes.c_int]
    return KernelBuild(fused, write, ranges, frozenset(name for i, name in enumerate(CODE_PATHS) if bits >> i & 1))


def _build_and_log() -> KernelBuild | None:
    build = build_kernels()
    if build is not None:
        logger.info("CPU LoRA kernel ready (code paths: %s)", ", ".join(sorted(build.code_paths)) or "C")
    return build


# The switch is read on every call; the build happens once (`serves` asks for every layer of every step).
_kernel: KernelSlot[KernelBuild] = KernelSlot(_build_and_log, envs.cpu_lora_kernel)


def kernel_build() -> KernelBuild | None:
    """The kernels (built once per process), or None if disabled or they cannot be built."""
    return _kernel.get()


def fused_function() -> Any:
    """The loaded kernel's `lora_fused` (a ctypes function), or None without the kernel."""
    build = kernel_build()
    return None if build is None else build.fused


def weight_ranges_function() -> Any:
    """The loaded kernel's `lora_weight_ranges` (a ctypes function), or None without the kernel."""
    build = kernel_build()
    return None if build is None else build.weight_ranges


def kernel_available() -> bool:
    """Whether the fused kernel (and `write_blocks`) run in C: not disabled, and built."""
    return kernel_build() is not None


def write_kernel_available() -> bool:
    """Whether `write_blocks` runs in C (same build and switch as the fused kernel)."""
    return kernel_available()


def write_blocks(records: array, scales: array) -> None:
    """Run the slot writes `records` (RECORD_LEN int64 per block; see lora_kernel.c) with their `scales`."""
    if len(records) != RECORD_LEN * len(scales) or records.typecode != "q" or scales.typecode != "f":
        raise ValueError(f"write_blocks needs {RECORD_LEN} int64 values and one float32 scale per block")
    build = _kernel.current()
    assert build is not None
    records_ptr, _ = records.buffer_info()
    scales_ptr, _ = scales.buffer_info()
    build.write(len(scales), records_ptr, scales_ptr, torch.get_num_threads())


def layer_args(
    a: torch.Tensor, b_t: torch.Tensor, slice_offsets: torch.Tensor, ranks: torch.Tensor, max_rank: int
) -> LayerArgs | None:
    """The per-layer half of the kernel's arguments, or None when the kernel cannot serve these buffers
    (not contiguous CPU tensors of one dtype, float32 or bfloat16, or no kernel). The kernel reads the
    buffers and `ranks` through raw pointers: they must stay alive and in place while the args are used.

    a [L, n*R, in]; b_t [L, n*R, out]; slice_offsets [n + 1] int64; ranks [L, n] int32; max_rank R.
    Raises ValueError for slice offsets that do not cut the outputs."""
    tensors = (a, b_t, slice_offsets, ranks)
    if a.dtype not in ELEM_TYPES or b_t.dtype != a.dtype or any(t.device.type != "cpu" for t in tensors):
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
    in_features, out_features = a.shape[2], b_t.shape[2]
    c_layer = (ctypes.c_int64 * 9)(ELEM_TYPES[a.dtype], in_features, out_features, a.data_ptr(), b_t.data_ptr(),
                                   max_rank, num_slices, slice_offsets.data_ptr(), ranks.data_ptr())
    return LayerArgs(a.dtype, in_features, out_features, a.shape[0], c_layer)


def max_segment_len(dtype: torch.dtype) -> int:
    """The longest per-slot token segment the kernel takes in this dtype here (0: not this dtype, or no kernel)."""
    build = kernel_build()
    if build is None or dtype not in _SEGMENT_LIMITS:
        return 0
    path, with_path, without = _SEGMENT_LIMITS[dtype]
    return with_path if path in build.code_paths else without


def serves(args: LayerArgs | None, mapping: LoRABatchMapping, dtype: torch.dtype) -> bool:
    """Whether the kernel runs the LoRA term of a layer whose buffers have `args` (None: buffers it
    cannot read) for this step, with activations of `dtype`: a CPU step (`mapping.cpu_kernel_args`),
    the buffers' dtype, every segment at most `max_segment_len(dtype)` tokens and every active slot
    one of the layer's. The one rule: `ops.add_lora` asks it, the decoder stack asks `serving`."""
    return args is not None and _step_served(mapping, dtype) and _layer_served(args, mapping, dtype)


def serving(layers: list[LayerArgs | None], mapping: LoRABatchMapping, dtype: torch.dtype) -> list[bool]:
    """`serves` for each of several layers in one step, the step's half asked once (it reads the
    kernel switch: ~4 us, where the decoder stack asks for every linear of every layer at once)."""
    step = _step_served(mapping, dtype)
    return [step and args is not None and _layer_served(args, mapping, dtype) for args in layers]


def _step_served(mapping: LoRABatchMapping, dtype: torch.dtype) -> bool:
    return mapping.cpu_kernel_args is not None and mapping.segments.max_len <= max_segment_len(dtype)


def _layer_served(args: LayerArgs, mapping: LoRABatchMapping, dtype: torch.dtype) -> bool:
    return args.dtype == dtype and (not mapping.active_slots or mapping.active_slots[-1] < args.num_slots)


def run(x: torch.Tensor, y: torch.Tensor, args: LayerArgs, mapping: LoRABatchMapping) -> torch.Tensor:
    """y[i] += Bt[s_i]^T A[s_i] x[i], slice by slice over each slot's ranks, for tokens with slot
    s_i >= 0; `args` from `layer_args`; call only where `serves`. Row i reads only slot s_i's blocks
    (a NaN slot reaches only its own tokens); rows of slot -1 are left alone. Same result as
    `lora_torch.add_lora` up to float summation order. In bfloat16: float32 sums and each element of y
    rounded once (to nearest even), where torch rounds the product and then the sum; t = A x is rounded
    to bfloat16 (to nearest even) before the expand, as torch and PEFT round it, where the build has
    AVX512-BF16, and stays float32 in the other builds (`KernelBuild.t_dtype` says which); with
    AVX512-BF16, denormals count as zero (vdpbf16ps flushes them).

    x [T, in]; y [T, out], updated in place and returned; both of the buffers' dtype."""
    build = _kernel.current()
    assert mapping.cpu_kernel_args is not None and build is not None
    if not (x.is_cpu and y.is_cpu and x.dim() == 2 and y.dim() == 2 and y.stride(1) == 1):
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} must be 2-D CPU rows, y's unit-stride")
    if x.stride(1) != 1:
        x = x.contiguous()
    if x.shape[0] != mapping.num_tokens or y.shape[0] != mapping.num_tokens \
            or (x.shape[1], y.shape[1]) != (args.in_features, args.out_features):
        raise ValueError(f"x {tuple(x.shape)} and y {tuple(y.shape)} do not fit {mapping.num_tokens} tokens "
                         f"and a layer of in={args.in_features}, out={args.out_features}")
    if x.dtype != args.dtype or y.dtype != args.dtype:
        raise ValueError(f"x ({x.dtype}) and y ({y.dtype}) are not of the LoRA buffers' dtype {args.dtype}")
    if mapping.active_slots and mapping.active_slots[-1] >= args.num_slots:
        raise ValueError(f"slot {mapping.active_slots[-1]} is out of range for a layer of {args.num_slots} slots")
    status = build.fused(args.c_layer, mapping.cpu_kernel_args, x.data_ptr(), x.stride(0), y.data_ptr(), y.stride(0),
                          torch.get_num_threads())
    if status != 0:
        raise MemoryError("CPU LoRA kernel could not allocate its scratch buffer")
    return y
