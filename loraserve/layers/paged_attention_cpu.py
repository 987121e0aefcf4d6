"""The CPU paged-attention kernel (`paged_attention.c`): built on first use, called through ctypes.

Built for this CPU on first use by `loraserve.native.build`. No compiler, a failed build, or
LORASERVE_CPU_ATTENTION_KERNEL=0 leaves the torch twin (`paged_attention_torch`) in charge; the
result is the same either way up to float summation order. The cache may hold any format of
`batch/kv_cache.py` (bf16 under float32 activations, fp8, int8 with its block scales): the kernel
writes the step's rows in that format and reads them in place; `KVFormat` describes it to the kernel.
"""

from __future__ import annotations

import ctypes
import logging
from typing import Any

import torch

from loraserve import envs
from loraserve.batch.attention_metadata import AttentionMetadata
from loraserve.batch.kv_cache import KVScales, has_block_scales
from loraserve.native.build import load_library
from loraserve.native.kernel_slot import KernelSlot

logger = logging.getLogger(__name__)

_DTYPES = (torch.float32, torch.bfloat16)  # q, out and the new rows
# The cache's element dtypes, as paged_attention_formats.h codes them.
_KV_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3, torch.int8: 4}


class KVFormat(ctypes.Structure):
    """paged_attention.c's `KVFormat`: the cache's element code, int8's block scales, fp8's tensor scales."""

    _fields_ = [("kind", ctypes.c_int64), ("k_scales", ctypes.c_void_p), ("v_scales", ctypes.c_void_p),
                ("k_scale", ctypes.c_float), ("v_scale", ctypes.c_float)]


def kernel_format(dtype: torch.dtype, scales: KVScales | None) -> KVFormat:
    """The kernel's descriptor of a cache of `dtype` read through `scales` (kept on `scales`, built once;
    without scales, fp8's 1.0). Call only where `serves` said yes."""
    held = None if scales is None else scales.kernel_format
    if held is not None and held[0] == dtype:
        return held[1]  # type: ignore[no-any-return]
    blocks = (None, None) if scales is None else (scales.k_blocks, scales.v_blocks)
    format = KVFormat(_KV_CODES[dtype], *(0 if t is None else t.data_ptr() for t in blocks),
                      1.0 if scales is None else scales.k, 1.0 if scales is None else scales.v)
    if scales is not None:
        scales.kernel_format = (dtype, format)
    return format


def bind(lib: ctypes.CDLL) -> Any:
    """The library's `paged_attention` entry point with its C signature (a build of paged_attention.c)."""
    fn = lib.paged_attention
    i64, ptr, f32 = ctypes.c_int64, ctypes.c_void_p, ctypes.c_float
    fn.restype = ctypes.c_int
    fn.argtypes = [ptr, i64, ptr, ptr, ptr, ptr, i64, ptr, ptr, i64, i64, i64, i64, i64, i64, i64,
                   f32, f32, i64, ctypes.c_int, ctypes.c_int, ptr, i64, ptr, i64, ptr, ctypes.POINTER(KVFormat)]
    return fn


def _load() -> Any:
    lib = load_library("paged_attention.c")
    if lib is None:
        return None
    try:
        return bind(lib)
    except AttributeError as e:
        logger.warning("CPU attention kernel unavailable (%s); using the torch path", e)
        return None


# The switch is read on every call (benchmarks flip it between steps); the build happens once.
_kernel: KernelSlot[Any] = KernelSlot(_load, envs.cpu_attention_kernel)


def kernel_available() -> bool:
    """Builds (once per process) and loads the kernel; False if disabled or it cannot be built."""
    return _kernel.get() is not None


def kernel_function() -> Any:
    """The loaded kernel's `paged_attention` (a ctypes function), or None where `kernel_available` is False."""
    return _kernel.get()


def _scales_serve(k_cache: torch.Tensor, scales: KVScales | None) -> bool:
    """int8's block scales as the kernel reads them: float32 [num_blocks, KVH], contiguous, on the CPU."""
    if not has_block_scales(k_cache.dtype):
        return True
    if scales is None or scales.k_blocks is None or scales.v_blocks is None or k_cache.dim() != 3:
        return False
    return all(t.is_cpu and t.dtype == torch.float32 and t.is_contiguous() and t.dim() == 2
               and t.shape[1] == k_cache.shape[1] for t in (scales.k_blocks, scales.v_blocks))


def serves(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
           new_kv: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
           scales: KVScales | None = None) -> bool:
    """Whether the kernel takes this call: CPU, q in float32 / bf16, caches alike in one format of
    `batch/kv_cache.py` (int8 with its block scales in `scales`), contiguous, q's heads packed ([T, H, D]
    with unit head-dim stride), a built kernel and, with `new_kv` (k, v, slot_mapping: the rows
    `write_and_attend` writes first), those rows in q's dtype as [T, KVH * D] with unit column stride
    and int64 slots. The one rule: `attend`, `write_and_attend` and the decoder stack
    (`models/llama_stack.py`) all ask it."""
    if not (q.is_cpu and k_cache.is_cpu and v_cache.is_cpu
            and q.dtype in _DTYPES and k_cache.dtype in _KV_CODES and v_cache.dtype == k_cache.dtype
            and q.dim() == 3 and q.stride(2) == 1 and q.stride(1) == q.shape[2]
            and k_cache.is_contiguous() and v_cache.is_contiguous() and _scales_serve(k_cache, scales)
            and kernel_available()):
        return False
    if new_kv is None:
        return True
    k, v, slots = new_kv
    num_tokens = q.shape[0]
    row = k_cache.shape[1] * k_cache.shape[2] if k_cache.dim() == 3 else -1
    return (all(t.is_cpu and t.dtype == q.dtype and t.dim() == 2 and t.shape == (num_tokens, row)
                and t.stride(1) == 1 for t in (k, v))
            and slots.dtype == torch.int64 and slots.is_contiguous() and slots.shape == (num_tokens,)
            and slots.is_cpu)


def check_inputs(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: tuple[torch.Tensor, ...],
                 block_size: int, scales: KVScales | None = None) -> None:
    """ValueError unless the caches (and int8's block scales), q's heads and the step's int32 index
    tensors fit one another."""
    block_tables, context_lens, query_starts = index
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[1]
    if k_cache.shape != v_cache.shape or k_cache.dim() != 3 or k_cache.shape[2] != head_dim \
            or k_cache.shape[0] % block_size != 0:
        raise ValueError(f"caches {tuple(k_cache.shape)} / {tuple(v_cache.shape)} do not fit q {tuple(q.shape)} "
                         f"and block_size {block_size}")
    if num_kv_heads == 0 or num_heads % num_kv_heads != 0:
        raise ValueError(f"{num_heads} query heads cannot share {num_kv_heads} KV heads evenly")
    if scales is not None and scales.k_blocks is not None and has_block_scales(k_cache.dtype):
        blocks = (k_cache.shape[0] // block_size, num_kv_heads)
        if any(t is None or tuple(t.shape) != blocks for t in (scales.k_blocks, scales.v_blocks)):
            raise ValueError(f"an int8 cache of {blocks[0]} blocks needs block scales of shape {blocks}")
    num_seqs = context_lens.shape[0]
    if any(t.dtype != torch.int32 or not t.is_contiguous() or t.device.type != "cpu" for t in index) \
            or block_tables.dim() != 2 or block_tables.shape[0] != num_seqs or query_starts.shape != (num_seqs + 1,):
        raise ValueError("block_tables [B, n], context_lens [B] and query_starts [B + 1] must be contiguous "
                         "int32 CPU tensors")


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_starts: torch.Tensor,
    block_size: int,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """Attention of a flat batch of new tokens over their sequences' paged context, K/V read in place.

    Semantics: those of `paged_attention_torch.paged_attention` (sequence b's tokens
    query_starts[b]..query_starts[b+1]-1 at positions ending at context_lens[b] - 1, causal, keys
    k > p - window with a window, GQA, optional softcap), accumulated in float32 with an online
    softmax; call only where `serves`. Raises ValueError for metadata that points outside the cache
    (a block id past its end, a query longer than its context) before reading anything.

    Shape: q [T, H, D] (token stride free) -> [T, H, D] contiguous, q's dtype; k_cache, v_cache
    [num_blocks * block_size, KVH, D] contiguous, in any format `serves` takes (read through `scales`);
    block_tables [B, max_blocks], context_lens [B], query_starts [B + 1], all int32."""
    if not kernel_available():
        raise RuntimeError("the CPU attention kernel is disabled or could not be built")
    return run_kernel(_kernel.current(), q, k_cache, v_cache, block_tables, context_lens, query_starts, block_size, scale,
                      softcap, window, scales=scales)


def run_kernel(
    kernel: Any,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    query_starts: torch.Tensor,
    block_size: int,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    new_kv: tuple[int | None, int, int | None, int, int | None] = (None, 0, None, 0, None),
    checked: bool = False,
    scales: KVScales | None = None,
) -> torch.Tensor:
    """`paged_attention` through the given `bind`-ed build (tests run every vector width's build).
    `new_kv` (k ptr, k row stride, v ptr, v row stride, slot_mapping ptr) makes the kernel write the
    step's K/V rows first; `checked` skips the tensor checks a caller already made this step."""
    index = (block_tables, context_lens, query_starts)
    if not checked:
        if not _scales_serve(k_cache, scales) or k_cache.dtype not in _KV_CODES:
            raise ValueError(f"a {k_cache.dtype} cache cannot be read here (int8 needs float32 block scales)")
        check_inputs(q, k_cache, v_cache, index, block_size, scales)
    num_tokens, num_heads, head_dim = q.shape
    out = torch.empty(num_tokens, num_heads, head_dim, dtype=q.dtype)
    if num_tokens == 0:
        return out
    status = kernel(
        q.data_ptr(), q.stride(0), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(),
        block_tables.data_ptr(), block_tables.shape[1], context_lens.data_ptr(), query_starts.data_ptr(),
        context_lens.shape[0], num_tokens, k_cache.shape[0] // block_size, num_heads, k_cache.shape[1],
        head_dim, block_size, scale, softcap or 0.0, window or 0, int(q.dtype == torch.bfloat16),
        torch.get_num_threads(), *new_kv, kernel_format(k_cache.dtype, scales),
    )
    raise_for_status(status, k_cache, block_size, num_tokens)
    return out


def raise_for_status(status: int, k_cache: torch.Tensor, block_size: int, num_tokens: int) -> None:
    if status == 2:
        raise ValueError(f"attention metadata points outside the KV cache ({k_cache.shape[0] // block_size} "
                         f"blocks) or its lengths do not add up to {num_tokens} tokens")
    if status != 0:
        raise MemoryError("CPU attention kernel could not allocate its scratch memory")


def _scales_layout(scales: KVScales | None) -> tuple[Any, ...]:
    if scales is None or scales.k_blocks is None or scales.v_blocks is None:
        return (scales is None or scales.k_blocks is None, scales is None or scales.v_blocks is None)
    return tuple((t.dtype, t.device, t.shape, t.stride()) for t in (scales.k_blocks, scales.v_blocks))


def write_and_attend(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    softcap: float | None = None,
    window: int | None = None,
    scales: KVScales | None = None,
) -> torch.Tensor | None:
    """The layer's whole step in one kernel call: the new K/V rows into their slots (as
    `kv_cache_formats.write_kv` would: `index_copy_(0, meta.slot_mapping, ...)` for a cache of q's dtype),
    then `paged_attention`. None when the kernel
    cannot serve these tensors: the caller then writes and attends on another path. The checks (and the
    kernel switch) run in full for the first layer of a step only: every layer shares the step's index
    tensors and, in a model, the tensor layouts; a layer whose layouts differ is checked in full.

    Shape: q [T, H, D]; k, v [T, KVH * D] (row stride free); caches [num_slots, KVH, D] -> [T, H, D]."""
    slots = meta.slot_mapping
    index = (meta.block_tables, meta.context_lens, meta.query_starts)
    # All that the checks depend on: the layouts by value, the step's index tensors by identity (one
    # swapped in after the first layer is checked too) and by layout (an id can be reused once freed).
    # Comparing this costs ~2 us where the checks take ~6 per layer.
    layout = (q.dtype, q.device, q.shape, q.stride(), k.dtype, k.device, k.shape, k.stride(), v.dtype, v.device,
              v.shape, v.stride(), k_cache.dtype, k_cache.device, k_cache.shape, k_cache.stride(), v_cache.dtype,
              v_cache.device, v_cache.shape, v_cache.stride(), slots.dtype, slots.device, slots.shape, slots.stride(),
              meta.block_size, *map(id, index), *(t.dtype for t in index), *(t.shape for t in index),
              *(t.stride() for t in index), *_scales_layout(scales))
    if meta.cpu_checked != layout:
        if not serves(q, k_cache, v_cache, (k, v, slots), scales):
            return None
        check_inputs(q, k_cache, v_cache, index, meta.block_size, scales)
        meta.cpu_checked = layout
    new_kv = (k.data_ptr(), k.stride(0), v.data_ptr(), v.stride(0), slots.data_ptr())
    return run_kernel(_kernel.current(), q, k_cache, v_cache, *index, meta.block_size, scale, softcap, window, new_kv, True,
                      scales)
