"""The CPU linear kernel (`gemm_kernel.c`): weights packed once into its block layout, then y = x W^T + b.

`pack` returns None where this CPU's build does not serve the dtype (bf16 needs AVX512-BF16; float32
needs AVX-512) or the kernel is switched off (LORASERVE_CPU_GEMM_KERNEL=0); the caller
then keeps oneDNN's packed linear. The twin is `F.linear` on the dense weight.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from loraserve import envs
from loraserve.native.build import cpu_flags, load_library
from loraserve.native.kernel_slot import KernelSlot

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def build_kernel(extra_flags: tuple[str, ...] = ()) -> Any:
    """A build of gemm_kernel.c (None without a compiler); `extra_flags` select other code paths."""
    lib = load_library("gemm_kernel.c", extra_flags=extra_flags)
    if lib is None:
        return None
    try:
        layout, run, run_packed = lib.gemm_pack_layout, lib.gemm_linear, lib.gemm_linear_packed
    except AttributeError:
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    layout.argtypes, layout.restype = [i32], i32
    run.argtypes, run.restype = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, ptr, i64, i64, i32, i32], i32
    run_packed.argtypes = [ctypes.POINTER(i64), ptr, i64, ptr, ptr, i64, i32]
    run_packed.restype = i32
    lib.gemm_linear_prefetch.argtypes = [ctypes.POINTER(i64), ptr, i64, ptr, ptr, i64, i32, ptr]
    lib.gemm_linear_prefetch.restype = i32
    return lib


_kernel: KernelSlot[Any] = KernelSlot(lambda: build_kernel() if envs.cpu_gemm_kernel() else None)


def kernel_library() -> Any:
    """The loaded kernel, or None if disabled or it cannot be built."""
    return _kernel.get()


def use_library(lib: Any) -> None:
    """Swap in another build (tests run every code path on one CPU this way)."""
    _kernel.use(lib)


@dataclass(slots=True)
class PackedWeight:
    """A [out, in] weight in the kernel's layout: [ceil(out / NB), in (even in bf16), NB] with NB =
    `block_layout(dtype)` (bf16 interleaves k pairs inside the last two dimensions; see gemm_kernel.c).
    `prefetch_next` is the weight of the linear that usually runs after this one (see `chain_prefetch`,
    its only writer). Neither it nor `data` changes once the weight has run: the kernel's arguments
    are bound from them at the first call."""

    data: torch.Tensor
    out_features: int
    in_features: int
    prefetch_next: PackedWeight | None = None
    call_args: Any = None  # ctypes int64[7] for gemm_linear_packed, bound at the first call


def call_args(weight: PackedWeight) -> Any:
    """The weight's fixed arguments of gemm_linear_packed {w, n, k, next_w, next_n, next_k, dtype}, bound
    at the first call. The array holds raw pointers: `weight` (which references both tensors) must
    outlive every call that uses it."""
    if weight.call_args is not None:
        return weight.call_args
    following = weight.prefetch_next
    next_args = (0, 0, 0) if following is None else (
        following.data.data_ptr(), following.out_features, following.in_features)
    weight.call_args = (ctypes.c_int64 * 7)(weight.data.data_ptr(), weight.out_features, weight.in_features,
                                            *next_args, _DTYPE_CODES[weight.data.dtype])
    return weight.call_args


def chain_prefetch(weights: list[PackedWeight]) -> None:
    """Link each weight to the one after it, the last to the first, in the order a forward pass runs
    them: while one linear finishes, each thread fetches its first block of the next into L2. A wrong
    order only wastes that prefetch."""
    for weight, following in zip(weights, weights[1:] + weights[:1]):
        weight.prefetch_next = following if following.data.dtype == weight.data.dtype else None
        weight.call_args = None


def block_layout(dtype: torch.dtype) -> int:
    """The block width the kernel packs this dtype with here; 0 when it does not serve it."""
    lib = kernel_library()
    if lib is None or dtype not in _DTYPE_CODES:
        return 0
    return int(lib.gemm_pack_layout(_DTYPE_CODES[dtype])) & 0xFFFF


def pack(weight: torch.Tensor) -> PackedWeight | None:
    """The kernel's copy of a CPU weight [out, in], or None where the kernel does not serve it."""
    if weight.device.type != "cpu" or weight.dim() != 2:
        return None
    cols = block_layout(weight.dtype)
    if cols == 0:
        return None
    out_features, in_features = weight.shape
    padded_out = -(-out_features // cols) * cols
    padded_in = in_features + (in_features % 2 if weight.dtype == torch.bfloat16 else 0)
    dense = weight.new_zeros(padded_out, padded_in)
    dense[:out_features, :in_features] = weight
    blocks = dense.view(padded_out // cols, cols, padded_in)
    if weight.dtype == torch.bfloat16:  # [blocks, cols, in/2, 2] -> [blocks, in/2, cols, 2]
        data = blocks.view(padded_out // cols, cols, padded_in // 2, 2).permute(0, 2, 1, 3)
    else:  # [blocks, cols, in] -> [blocks, in, cols]
        data = blocks.permute(0, 2, 1)
    return PackedWeight(data.contiguous(), out_features, in_features)


def prefers_onednn(dtype: torch.dtype) -> bool:
    """Whether this CPU's bf16 linears should stay with oneDNN: with AMX, oneDNN runs them on the tile
    units, which the kernel's vdpbf16ps does not approach (benchmarks/README.md, "AMX"). Only when
    LORASERVE_CPU_GEMM_KERNEL is unset; "1" keeps the kernel (the tests pin it), "0" keeps oneDNN."""
    return dtype == torch.bfloat16 and "amx_bf16" in cpu_flags() and not envs.cpu_gemm_kernel_forced()


def serves(weight: PackedWeight | None, dtype: torch.dtype) -> bool:
    """Whether `linear` runs a layer whose kernel weight is `weight` (None: `pack` did not serve it)
    for activations of `dtype`. The one rule: `Linear.base_forward` and the decoder stack both ask it."""
    return weight is not None and weight.data.dtype == dtype


def linear(x: torch.Tensor, weight: PackedWeight, bias: torch.Tensor | None) -> torch.Tensor:
    """Semantics: F.linear(x, W, bias) with W the packed weight's dense [out, in]: float32 sums, one
    rounding to x's dtype at the end, the bias added before it; in bf16, denormal inputs and results
    count as zero (vdpbf16ps). Shape: x [..., in] -> [..., out]; bias [out] or None."""
    data, in_features, out_features = weight.data, weight.in_features, weight.out_features
    if not serves(weight, x.dtype) or not x.is_cpu:
        raise TypeError(f"linear: x is {x.dtype} on {x.device}, the packed weight {data.dtype} on CPU")
    if x.shape[-1] != in_features:
        raise ValueError(f"linear: x has {x.shape[-1]} features, the weight takes {in_features}")
    if bias is not None:
        if bias.shape != (out_features,) or not bias.is_cpu:
            raise ValueError(f"linear: bias {tuple(bias.shape)} on {bias.device}, the layer has {out_features} "
                             "outputs on CPU")
        bias = bias.to(x.dtype).contiguous()  # held until the call returns: the kernel reads it raw
    lib = _kernel.get()
    if lib is None:
        raise RuntimeError("linear: the weight was packed for the C linear kernel, which this process "
                           "has not loaded (LORASERVE_CPU_GEMM_KERNEL=0, or no C compiler)")
    rows = x if x.dim() == 2 else x.reshape(-1, in_features)
    if rows.stride(1) != 1:
        rows = rows.contiguous()
    num_rows = rows.shape[0]
    out = torch.empty((num_rows, out_features), dtype=x.dtype)
    status = lib.gemm_linear_packed(call_args(weight), rows.data_ptr(), rows.stride(0),
                                    None if bias is None else bias.data_ptr(), out.data_ptr(), num_rows,
                                    torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"the CPU linear kernel refused {x.dtype} (status {status})")
    return out if x.dim() == 2 else out.view(*x.shape[:-1], out_features)


def linear_twin(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What `linear` computes, from the dense weight: the test oracle and the path without the kernel."""
    return F.linear(x, weight, bias)
