"""`argmax_rows`: torch.argmax over the last dim of a [rows, vocab] tensor, fast on CPU.

Greedy decoding runs it on every step's logits. On CPU the C kernel (`argmax_kernel.c`) takes
float32 and bf16 rows as they are, so the LM head's bf16 logits need no float32 copy. Without it
(other devices, other dtypes, no compiler, LORASERVE_CPU_ARGMAX_KERNEL=0) torch runs: its CPU argmax
walks a long row one element at a time (an order of magnitude slower than its vectorised `amax`; the
figures are in benchmarks/README.md), so the row is cut into CHUNK-wide pieces: a vectorised `amax`
per piece, an argmax over the few piece maxima, then an argmax inside the winning piece. Every path gives
torch.argmax's answer, ties and NaNs included: the first maximum wins, and a NaN counts as the
maximum (the first NaN wins).
"""

from __future__ import annotations

import ctypes
from typing import Any

import torch

from loraserve import envs
from loraserve.native.build import load_library
from loraserve.native.kernel_slot import KernelSlot

CHUNK = 128
# Rows shorter than this go straight to torch.argmax: the three small ops would not pay off.
MIN_FAST_LEN = 16 * CHUNK
_DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1}


def build_kernel(extra_flags: tuple[str, ...] = ()) -> Any:
    """`argmax_rows` of a build of argmax_kernel.c (a ctypes function), or None without a compiler;
    `extra_flags` select another code path (tests run the portable one on any CPU)."""
    lib = load_library("argmax_kernel.c", extra_flags=extra_flags)
    if lib is None:
        return None
    i64 = ctypes.c_int64
    lib.argmax_rows.argtypes = [ctypes.c_void_p, i64, i64, i64, ctypes.c_int, ctypes.c_void_p, ctypes.c_int]
    lib.argmax_rows.restype = ctypes.c_int
    return lib.argmax_rows


_kernel: KernelSlot[Any] = KernelSlot(lambda: build_kernel() if envs.cpu_argmax_kernel() else None)


def kernel_function() -> Any:
    """This process's build of the kernel (built once), or None: disabled, or no compiler."""
    return _kernel.get()


def kernel_argmax(kernel: Any, x: torch.Tensor) -> torch.Tensor | None:
    """argmax_rows through `kernel` (a `build_kernel` result), or None where it does not serve x."""
    if kernel is None or x.dim() != 2 or not x.is_cpu or x.dtype not in _DTYPE_CODES or x.shape[1] == 0 \
            or x.stride(1) != 1:
        return None
    out = torch.empty(x.shape[0], dtype=torch.long)
    if x.shape[0] > 0 and kernel(x.data_ptr(), x.stride(0), x.shape[0], x.shape[1], _DTYPE_CODES[x.dtype],
                                 out.data_ptr(), torch.get_num_threads()) != 0:
        return None
    return out


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """Semantics: torch.argmax(x.float(), dim=-1). Shape: x [rows, vocab] -> [rows] int64."""
    out = kernel_argmax(kernel_function(), x)
    if out is not None:
        return out
    return torch_argmax(x.float() if x.dtype == torch.bfloat16 else x)


def torch_argmax(x: torch.Tensor) -> torch.Tensor:
    """The torch path of argmax_rows (the kernel's twin), for rows of any dtype torch compares."""
    if x.dim() != 2 or x.shape[1] < MIN_FAST_LEN or x.stride(1) != 1 or not x.dtype.is_floating_point:
        return x.argmax(dim=-1)
    rows, vocab = x.shape
    main = vocab - vocab % CHUNK
    pieces = x[:, :main].unflatten(1, (main // CHUNK, CHUNK))  # a view: [rows, pieces, CHUNK]
    piece_max = pieces.amax(dim=-1)  # NaN-propagating, like argmax's treatment of NaN
    piece = piece_max.argmax(dim=-1)
    inside = pieces[torch.arange(rows, device=x.device), piece].argmax(dim=-1)
    best = piece * CHUNK + inside
    if main == vocab:
        return best
    tail_max, tail_at = x[:, main:].max(dim=-1)
    best_max = piece_max.gather(1, piece.unsqueeze(1)).squeeze(1)
    # The tail comes after every piece: it wins only when strictly greater, or a NaN facing none.
    tail_wins = (tail_max > best_max) | (tail_max.isnan() & ~best_max.isnan())
    return torch.where(tail_wins, tail_at + main, best)
