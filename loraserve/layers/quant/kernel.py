"""The CPU linear over a block-quantized weight (quant_kernel.c): y = x W^T + b with W kept in its GGUF
format in memory.

The kernel's integer path quantizes the activations per 32 values (per 256 for the K-quants) to int8 for
integer dot products, as llama.cpp does; float32 ones may take two int8 levels, the second quantizing
what the first leaves (amax/32512 per value, LORASERVE_CPU_QUANT_ACT_LEVELS=2). Every format
at one level is packed at load in panels of 8 rows and takes one path for every row count
(quant_kernel_packed.h, quant_kernel_kpacked.h). In the row layout (two levels, rows not a multiple of
8, LORASERVE_CPU_QUANT_LAYOUT=rows) few rows stream the weight's bytes once (decode), more rows at one
level on a vector build unpack each chunk of weight rows once into 8-row panels that all of x's rows pass
(quant_kernel_panel.h). At two levels or on the portable build they serve up to `DECODE_ROWS` rows;
more take tiles of W dequantized into a cache-sized buffer in x's dtype and multiplied by torch
(oneDNN). Without a C compiler both paths are the twin: torch's dequantize then F.linear.
"""

from __future__ import annotations

import ctypes
import sys
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from loraserve import envs
from loraserve.layers.quant.formats import QuantTensor, repack_panels, repack_rows
from loraserve.native.build import function_address, load_library
from loraserve.native.kernel_slot import KernelSlot

# At most this many rows take the integer path at two activation levels or on the portable build (one
# level on a vector build: every row count). Measured before the panel path (AVX2 EPYC, family 25 model
# 1, 1 thread, float32 x; tile-path time over integer-path time) at 8 / 24 / 32 / 48 rows: Q4_1 1536x576
# 2.24 / 1.24 / 1.10 / 1.00; Q8_0 8192x2048 2.82 / 1.65 / 1.40 / 1.28; Q4_K 8192x2048 3.23 / 1.71 /
# 1.18 / 0.87-1.47; Q6_K 2048x8192 4.02 / 2.05 / 1.92 / 1.63. The panel path at 128 rows, same machine,
# 2 threads, Llama-3.2-1B's shapes: Q4_K 107 GMAC/s, Q6_K 70, Q8_0 64 against the tile path's 40-41.
DECODE_ROWS = 32
TILE_BYTES = 1 << 20  # a dequantized tile of the prefill path: about L2's size
PATHS = {2: "avx512_vnni", 1: "avx2", 0: "portable"}
_DTYPES = {torch.float32: 0, torch.bfloat16: 1}


def build_kernel(extra_flags: tuple[str, ...] = ()) -> Any:
    """A build of quant_kernel.c (None without a compiler); `extra_flags` select other code paths."""
    # No contraction: the tile path rounds s * q + add twice, as the torch twin does (a per-function
    # optimize attribute instead keeps GCC from inlining the vector helpers: 5x slower).
    flags = ("-ffp-contract=off", *extra_flags)
    lib = load_library("quant_kernel.c", extra_flags=flags)
    if lib is None:
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.quant_linear.argtypes = [ctypes.POINTER(i64), ptr, i64, i32, ptr, ptr, i64, i64, i32]
    lib.quant_linear.restype = i32
    lib.quant_dequantize.argtypes = [ctypes.POINTER(i64), i64, i64, ptr, i32, i32]
    lib.quant_dequantize.restype = i32
    lib.quant_embed.argtypes = [ctypes.POINTER(i64), ptr, i64, ptr, i32, i32]
    lib.quant_embed.restype = i32
    lib.quant_kernel_path.restype = i32
    lib.quant_gemm.restype = i32
    return lib


_kernel: KernelSlot[Any] = KernelSlot(build_kernel)
def kernel_library() -> Any:
    """The loaded kernel (built once per process), or None without a build."""
    return _kernel.get()


def use_library(lib: Any) -> None:
    """Swap in another build (tests run every code path on one CPU this way; None: the twin)."""
    _kernel.use(lib)


def kernel_path() -> str:
    """The integer dot product this process's build runs ("twin" without a build)."""
    lib = kernel_library()
    return "twin" if lib is None else PATHS[int(lib.quant_kernel_path())]


@dataclass(slots=True)
class QuantWeight:
    """A quantized weight as the kernel reads it; `args` ({address, out, in, type code}) bound once.
    `tensor.blocks` must not be replaced while the weight is in use (the kernel reads it raw).
    `act_levels`: int8 levels float32 activations are quantized to on the decode path (1, llama.cpp's
    precision, or 2: to amax / 32512 per value, about 1.6x the integer work; bf16 takes one)."""

    tensor: QuantTensor
    act_levels: int = 1
    args: Any = None

    def x_flags(self, dtype: torch.dtype) -> int:
        """The kernel's flags for activations of `dtype`: bit 0 bf16, bit 1 two levels (float32)."""
        return _DTYPES[dtype] | (2 if dtype == torch.float32 and self.act_levels == 2 else 0)

    @property
    def out_features(self) -> int:
        return self.tensor.shape[0]

    @property
    def in_features(self) -> int:
        return self.tensor.shape[1]

    def call_args(self) -> Any:
        if self.args is None:
            self.args = _tensor_args(self.tensor)
        return self.args


def _tensor_args(tensor: QuantTensor) -> Any:
    """The kernel's weight argument {address, out, in, type code} of `tensor`."""
    return (ctypes.c_int64 * 4)(tensor.blocks.data_ptr(), *tensor.shape, tensor.qtype.code)


def integer_rows(weight: QuantWeight, dtype: torch.dtype) -> int:
    """The most rows of `dtype` x the integer path takes for `weight` (more take the tile path)."""
    if weight.tensor.qtype.panels_of is not None:  # packed in panels: one path for every row count
        return sys.maxsize
    lib = kernel_library()
    panels = lib is not None and int(lib.quant_kernel_path()) > 0 and not weight.x_flags(dtype) & 2
    return sys.maxsize if panels else DECODE_ROWS


def stack_serves(parts: list[QuantWeight | None] | None, dtype: torch.dtype, in_features: int) -> bool:
    """Whether the decoder stack's C linear (`quant_gemm`) runs a layer of these slices in `dtype`:
    the kernel is built, every slice is there and takes `in_features`. It serves steps of at most
    `integer_rows` rows (more take the tile path, which is torch's: the stack leaves those steps)."""
    return (
        parts is not None
        and dtype in _DTYPES
        and kernel_library() is not None
        and all(part is not None and part.in_features == in_features for part in parts)
        and len({part.act_levels for part in parts if part is not None}) == 1
    )


def stack_binding(parts: list[QuantWeight | None], dtype: torch.dtype) -> tuple[int, Any]:
    """(address of quant_gemm, its argument array for these slices): what the decoder stack binds for a
    layer `stack_serves` accepted. The array holds raw pointers: the slices must outlive its calls."""
    first = parts[0]
    assert first is not None  # stack_serves checked
    fields = [len(parts), first.x_flags(dtype), sum(part.out_features for part in parts if part is not None)]
    for part in parts:
        assert part is not None  # stack_serves checked
        fields += list(part.call_args())
    return function_address(kernel_library().quant_gemm), (ctypes.c_int64 * len(fields))(*fields)


def prepare(tensor: QuantTensor, act_levels: int | None = None, layout: str | None = None) -> QuantWeight:
    """The kernel's weight for `tensor` (its blocks contiguous, on CPU). At one activation level every
    format takes panels of 8 rows (`formats.repack_panels`: one kernel path for every row count, so a
    row's result does not depend on its batch), else Q8_0 / Q4_0 / Q4_1 their row layout
    (`formats.repack_rows`) and the K-quants the file's; `act_levels` None takes LORASERVE_CPU_QUANT_ACT_LEVELS (default 1), `layout`
    None LORASERVE_CPU_QUANT_LAYOUT (default panels)."""
    levels = envs.cpu_quant_act_levels() if act_levels is None else act_levels
    if levels not in (1, 2):
        raise ValueError(f"activation levels are 1 or 2, got {levels}")
    layout = envs.cpu_quant_layout() if layout is None else layout
    if layout not in ("panels", "rows"):
        raise ValueError(f"quantized weight layouts are panels or rows, got {layout!r}")
    if levels == 1 and layout == "panels":
        tensor = repack_panels(tensor)
    if tensor.qtype.panels_of is None:  # two levels, rows asked for, or rows not a multiple of 8
        tensor = repack_rows(tensor)
    blocks = tensor.blocks.contiguous().cpu()
    return QuantWeight(QuantTensor(blocks, tensor.qtype, tensor.shape), levels)


def linear(
    x: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None = None, out: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear(x, dequantized W, bias) for float32 or bf16 x [..., in] -> [..., out] (float32 sums, one
    rounding to x's dtype; on the decode path activations are quantized per 32, so the result is within
    amax/254 (bf16 x) or amax/32512 (float32 x) per block of x times sum |w| of it). `out`, if given, is
    a [rows, out] view (row stride free, columns contiguous) the result is written into (a packed
    layer's slice)."""
    if x.dtype not in _DTYPES or not x.is_cpu:
        raise TypeError(f"quantized linear: x is {x.dtype} on {x.device}; it takes float32 or bf16 on CPU")
    n, k = weight.tensor.shape
    if x.shape[-1] != k:
        raise ValueError(f"quantized linear: x has {x.shape[-1]} features, the weight takes {k}")
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if bias is not None:
        bias = bias.to(x.dtype).contiguous()
    y = torch.empty(rows.shape[0], n, dtype=x.dtype) if out is None else out
    lib = _kernel.get()
    if lib is None:
        y.copy_(F.linear(rows, weight.tensor.dequantize(x.dtype), bias))
    elif rows.shape[0] <= integer_rows(weight, x.dtype):
        status = lib.quant_linear(
            weight.call_args(),
            rows.data_ptr(),
            rows.stride(0),
            weight.x_flags(x.dtype),
            None if bias is None else bias.data_ptr(),
            y.data_ptr(),
            y.stride(0),
            rows.shape[0],
            torch.get_num_threads(),
        )
        if status != 0:
            raise RuntimeError(f"the quantized linear kernel refused its arguments (status {status})")
    else:
        _tiled(lib, rows, weight, bias, y)
    return y if out is not None or x.dim() == 2 else y.view(*x.shape[:-1], n)


def _tiled(
    lib: Any, rows: torch.Tensor, weight: QuantWeight, bias: torch.Tensor | None, y: torch.Tensor
) -> None:
    """The prefill path: tiles of W's rows dequantized in x's dtype, each multiplied by torch."""
    n, k = weight.tensor.shape
    tile_rows = max(16, TILE_BYTES // (k * rows.element_size()) // 16 * 16)
    tile = torch.empty(min(tile_rows, n), k, dtype=rows.dtype)
    for n0 in range(0, n, tile_rows):
        n1 = min(n, n0 + tile_rows)
        status = lib.quant_dequantize(
            weight.call_args(), n0, n1, tile.data_ptr(), _DTYPES[rows.dtype], torch.get_num_threads()
        )
        if status != 0:
            raise RuntimeError(f"the quantized linear kernel refused its arguments (status {status})")
        y[:, n0:n1] = F.linear(rows, tile[: n1 - n0], None if bias is None else bias[n0:n1])


def embedding_rows(tensor: QuantTensor, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor | None:
    """Rows `ids` (int64, contiguous) of `tensor` in `dtype` [ids.numel(), in]: `formats.dequantize`'s
    values, gathered by the kernel; None where it is not built or `dtype` is neither float32 nor bf16 (the
    caller then takes the twin, as for a table or ids off the CPU). Raises IndexError for an id outside the
    table, as nn.Embedding does."""
    lib = kernel_library()
    if lib is None or dtype not in _DTYPES or not tensor.blocks.is_cpu or not ids.is_cpu:
        return None
    out = torch.empty(ids.numel(), tensor.shape[1], dtype=dtype)
    status = lib.quant_embed(_tensor_args(tensor), ids.data_ptr(), ids.numel(), out.data_ptr(), _DTYPES[dtype], torch.get_num_threads())
    if status == 3:
        raise IndexError("index out of range in self")
    if status != 0:
        raise RuntimeError(f"the quantized embedding kernel refused its arguments (status {status})")
    return out


def dequantize_rows(weight: QuantWeight, dtype: torch.dtype) -> torch.Tensor:
    """The whole dense weight in `dtype` (float32 or bf16) through the kernel where it is built."""
    lib = kernel_library()
    n, k = weight.tensor.shape
    if lib is None or dtype not in _DTYPES or weight.tensor.qtype.panels_of is not None:
        return weight.tensor.dequantize(dtype)
    dense = torch.empty(n, k, dtype=dtype)
    if lib.quant_dequantize(
        weight.call_args(), 0, n, dense.data_ptr(), _DTYPES[dtype], torch.get_num_threads()
    ):
        raise RuntimeError("the quantized linear kernel refused its arguments")
    return dense
