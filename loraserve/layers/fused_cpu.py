"""Fused elementwise ops of a decoder layer: RMSNorm (with the residual add), SiLU-and-mul, rope,
and Gemma's (1 + w) RMSNorm and GeGLU (gelu-tanh-and-mul).

Each op has a pure-torch twin (the semantics, and the path on CUDA, for other dtypes, without a C
compiler, or with LORASERVE_CPU_FUSED_OPS=0) and a C kernel (`fused_kernel.c`, built for this CPU by
`loraserve.native.build`) that does the same in one pass over the rows. A decode step of a small
model spends as much time in these elementwise ops, their temporaries and their dispatch as in its
matmuls; bf16 elementwise ops are especially slow in torch on CPU.
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from loraserve import envs
from loraserve.native.build import load_library
from loraserve.native.kernel_slot import KernelSlot

_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}
MAX_ROTARY_HEAD_DIM = 1024  # fused_kernel.c's MAX_ROTARY_HALF * 2: the kernel's per-row table copy


def build_kernel(arch: str | None = None) -> Any:
    """A build of fused_kernel.c with its entry points bound (None without a compiler); `arch` builds
    another CPU class's code paths (tests run them all on one CPU)."""
    lib = load_library("fused_kernel.c", arch=arch)
    if lib is None:
        return None
    i64, ptr, i32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_int
    lib.silu_and_mul.argtypes = [ptr, i64, ptr, i64, i64, i64, i32, i32]
    lib.rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_float, i32, i32]
    try:
        lib.rotary_inplace.argtypes = [ptr, i64, ptr, ptr, ptr, i64, i64, i64, i64, i32, i32]
        lib.rotary_inplace.restype = ctypes.c_int
        lib.gelu_tanh_and_mul.argtypes = lib.silu_and_mul.argtypes
        lib.offset_rms_norm.argtypes = [ptr, i64, ptr, i64, ptr, i64, ptr, i64, i64, ctypes.c_float, i32, i32, i32]
        for fn in (lib.silu_and_mul, lib.rms_norm, lib.gelu_tanh_and_mul, lib.offset_rms_norm):
            fn.restype = None
    except AttributeError:  # a library without these symbols: the twins run
        return None
    return lib


# The switch is read once, on the first ask: these ops run ~10 times per layer and step.
_kernel: KernelSlot[Any] = KernelSlot(lambda: build_kernel() if envs.cpu_fused_ops() else None)


def kernel_available() -> bool:
    """Builds (once per process) and loads the kernel; False if disabled or it cannot be built."""
    return _kernel.get() is not None


def kernel_library() -> Any:
    """The loaded kernel library (rms_norm, silu_and_mul, rotary_inplace, offset_rms_norm,
    gelu_tanh_and_mul), or None without it."""
    return _kernel.get()


def _lib() -> Any:
    """The library an op calls once `_served` said the kernel serves it (so it is loaded)."""
    return _kernel.current()


def _served(*tensors: torch.Tensor) -> bool:
    """Whether the kernel serves these 2-D row-major CPU tensors of one supported dtype. Plain loops
    and `is_cpu`: this runs ~4 times per layer and step, where a generator costs more than the op."""
    dtype = tensors[0].dtype
    if dtype not in _DTYPE_CODES:
        return False
    for t in tensors:
        if t.dtype != dtype or not t.is_cpu or t.dim() != 2 or t.stride(1) != 1:
            return False
    return kernel_available()


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Semantics: with a residual, residual = x + residual (in place, rounded to the dtype) and the
    norm reads it; out = weight * (h * rsqrt(mean(h^2) + eps)).to(dtype) with h the row in float32.
    Returns (out, residual). Shape: x, residual [T, D]; weight [D] -> out [T, D]."""
    if not (_served(x) and (residual is None or (_served(x, residual) and residual.shape == x.shape))
            and norm_weight_serves(weight, x.dtype, x.shape[-1])):
        return rms_norm_twin(x, weight, eps, residual)
    out = torch.empty_like(x)
    res_ptr, res_ld = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
    _lib().rms_norm(x.data_ptr(), x.stride(0), res_ptr, res_ld, out.data_ptr(), out.stride(0), weight.data_ptr(),
                  x.shape[0], x.shape[1], eps, _DTYPE_CODES[x.dtype], torch.get_num_threads())
    return out, residual


def norm_weight_serves(weight: torch.Tensor, dtype: torch.dtype, width: int) -> bool:
    """Whether the RMSNorm kernel reads `weight` for rows of `dtype` and `width`: of that dtype,
    contiguous, [width]. `rms_norm` and the decoder stack both ask it."""
    return weight.dtype == dtype and weight.is_contiguous() and weight.shape == (width,)


def rms_norm_twin(
    x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor | None]:
    if residual is not None:
        residual.add_(x)
        x = residual
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype), residual


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Semantics: silu(gate) * up with gate, up = x.split(half). Shape: x [T, 2I] -> [T, I]."""
    width = x.shape[-1] // 2
    if not _served(x) or x.shape[-1] % 2:
        return silu_and_mul_twin(x)
    out = x.new_empty(x.shape[0], width)
    _lib().silu_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0], width,
                      _DTYPE_CODES[x.dtype], torch.get_num_threads())
    return out


def silu_and_mul_twin(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def rotary_(
    x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    num_heads: int, head_dim: int,
) -> None:
    """Semantics: rope (half-split layout) on the first num_heads heads of each row of x, in place:
    x_h = x_h * cos[pos] + rotate_half(x_h) * sin[pos], the float32 tables cast to x's dtype first.
    Shape: x [T, >= num_heads * head_dim] (row stride free); positions [T] int64; tables [P, head_dim]."""
    if not (_served(x) and positions.dtype == torch.int64 and positions.is_contiguous()
            and positions.shape == (x.shape[0],) and x.shape[1] >= num_heads * head_dim
            and rotary_tables_serve(cos_table, sin_table, head_dim)):
        rotary_twin_(x, positions, cos_table, sin_table, num_heads, head_dim)
        return
    status = _lib().rotary_inplace(x.data_ptr(), x.stride(0), positions.data_ptr(), cos_table.data_ptr(),
                                 sin_table.data_ptr(), cos_table.shape[0], x.shape[0], num_heads, head_dim,
                                 _DTYPE_CODES[x.dtype], torch.get_num_threads())
    if status == 1:
        raise IndexError(f"a position is outside the rotary tables ({cos_table.shape[0]} positions)")
    if status != 0:
        raise ValueError(f"the rotary kernel refused head_dim={head_dim} (status {status})")


def rotary_tables_serve(cos_table: torch.Tensor, sin_table: torch.Tensor, head_dim: int) -> bool:
    """Whether the rope kernel takes these tables for heads of `head_dim`: float32 [P, head_dim]
    contiguous CPU tables of one shape, an even head_dim within MAX_ROTARY_HEAD_DIM. `rotary_` and the
    decoder stack both ask it."""
    return (head_dim % 2 == 0 and head_dim <= MAX_ROTARY_HEAD_DIM and sin_table.shape == cos_table.shape
            and all(t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 2 and t.shape[1] == head_dim
                    and t.device.type == "cpu" for t in (cos_table, sin_table)))


def rotary_twin_(
    x: torch.Tensor, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor,
    num_heads: int, head_dim: int,
) -> None:
    heads = x[:, : num_heads * head_dim].unflatten(-1, (num_heads, head_dim))
    cos = cos_table.index_select(0, positions).unsqueeze(1).to(x.dtype)
    sin = sin_table.index_select(0, positions).unsqueeze(1).to(x.dtype)
    half = head_dim // 2
    rotated = torch.cat([-heads[..., half:], heads[..., :half]], dim=-1)
    heads.copy_(heads * cos + rotated * sin)


# offset_rms_norm's modes: the norm alone, residual add then norm, norm then residual add.
NORM_ONLY, ADD_THEN_NORM, NORM_THEN_ADD = 0, 1, 2


def offset_rms_norm(x: torch.Tensor, scale: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                    mode: int = NORM_ONLY) -> torch.Tensor:
    """Gemma's RMSNorm, scale = 1 + w in float32: out = (h * rsqrt(mean(h^2) + eps) * scale).to(dtype)
    with h the row in float32, rounded once. ADD_THEN_NORM: residual += x (in place, rounded) and the
    norm reads it, returns out; NORM_THEN_ADD: residual += norm(x) (in place, each rounded), returns
    residual. Shape: x, residual [T, D]; scale [D] float32 -> [T, D]."""
    served = (_served(x) if residual is None else (_served(x, residual) and residual.shape == x.shape)) \
        and offset_scale_serves(scale, x.shape[-1])
    if not served:
        return offset_rms_norm_twin(x, scale, eps, residual, mode)
    out = residual if mode == NORM_THEN_ADD else torch.empty_like(x)
    assert out is not None
    res_ptr, res_ld = (residual.data_ptr(), residual.stride(0)) if residual is not None else (None, 0)
    _lib().offset_rms_norm(x.data_ptr(), x.stride(0), res_ptr, res_ld, out.data_ptr(), out.stride(0), scale.data_ptr(),
                         x.shape[0], x.shape[1], eps, mode, _DTYPE_CODES[x.dtype], torch.get_num_threads())
    return out


def offset_scale_serves(scale: torch.Tensor, width: int) -> bool:
    """Whether offset_rms_norm's kernel reads `scale`: float32, contiguous, CPU, [width]."""
    return scale.dtype == torch.float32 and scale.is_contiguous() and scale.shape == (width,) and scale.is_cpu


def offset_rms_norm_twin(x: torch.Tensor, scale: torch.Tensor, eps: float, residual: torch.Tensor | None = None,
                         mode: int = NORM_ONLY) -> torch.Tensor:
    if mode == ADD_THEN_NORM:
        assert residual is not None
        x = residual.add_(x)
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    out = (h * scale).to(x.dtype)
    if mode == NORM_THEN_ADD:
        assert residual is not None
        return residual.add_(out)
    return out


def gelu_tanh_and_mul(x: torch.Tensor) -> torch.Tensor:
    """Semantics: gelu(gate, approximate="tanh") * up with gate, up = x.split(half) (GeGLU).
    Shape: x [T, 2I] -> [T, I]."""
    width = x.shape[-1] // 2
    if not _served(x) or x.shape[-1] % 2:
        return gelu_tanh_and_mul_twin(x)
    out = x.new_empty(x.shape[0], width)
    _lib().gelu_tanh_and_mul(x.data_ptr(), x.stride(0), out.data_ptr(), out.stride(0), x.shape[0], width,
                           _DTYPE_CODES[x.dtype], torch.get_num_threads())
    return out


def gelu_tanh_and_mul_twin(x: torch.Tensor) -> torch.Tensor:
    gate, up = x.split(x.shape[-1] // 2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up
