"""`BlockWriter`: many small block copies into slot buffers, batched into one C kernel call.

Activating an adapter copies A and the transposed, scaled B of every LoRA module into the slot
buffers, and zeroes what the slot's previous adapter left beyond the new ranks. As torch ops that is
~3 small ops per module (~600 for an all-7-projection adapter of a 30-layer model, ~20 ms on a small
CPU); the writer records them as (pointer, strides, shape) rows and runs them in one call of the C
kernel (`lora_write_blocks`, float32 or bfloat16 with the scale applied in float32), or falls back to
the same torch ops for other dtypes and devices.
"""

from __future__ import annotations

from array import array

import torch

from loraserve.lora.ops import lora_cpu


class BlockWriter:
    """Collects block writes `dst[slot, rows, cols] = scale * src` (src None: zeros) until `flush`.

    dst buffers are [max_loras, rows, width] contiguous; src is [rows, cols], or [cols, rows] when
    `transposed` (lora_b written as its transpose); callers check the shapes (the kernel reads through
    raw pointers). Sources are kept alive until the flush. Blocks of one flush must not overlap: they
    are written in parallel, in no set order.
    """

    def __init__(self) -> None:
        self._use_kernel = lora_cpu.write_kernel_available()
        self._records = array("q")
        self._scales = array("f")
        self._sources: list[torch.Tensor] = []
        self._layouts: dict[int, tuple[int, int, int] | None] = {}
        self._buffers: list[torch.Tensor] = []

    def write(self, dst: torch.Tensor, slot: int, row: int, num_rows: int, lo: int, hi: int,
              src: torch.Tensor | None, scale: float = 1.0, transposed: bool = False) -> None:
        if num_rows <= 0 or hi <= lo:
            return
        layout = self._dst_layout(dst) if self._use_kernel else None
        if layout is None or not (src is None or (src.dtype == dst.dtype and src.is_cpu and src.dim() == 2)):
            self._write_now(dst[slot, row : row + num_rows, lo:hi], src, scale, transposed)
            return
        base, num_rows_per_slot, width = layout
        dst_ptr = base + dst.element_size() * ((slot * num_rows_per_slot + row) * width + lo)
        elem = lora_cpu.ELEM_TYPES[dst.dtype]
        if src is None:
            self._records.extend((dst_ptr, width, 0, 0, 0, num_rows, hi - lo, elem))
        else:
            row_stride, col_stride = (src.stride(1), src.stride(0)) if transposed else src.stride()
            self._records.extend((dst_ptr, width, src.data_ptr(), row_stride, col_stride, num_rows, hi - lo, elem))
            self._sources.append(src)
        self._scales.append(scale)

    def _dst_layout(self, dst: torch.Tensor) -> tuple[int, int, int] | None:
        """(data pointer, rows per slot, width) of a contiguous CPU [slots, rows, width] buffer of a
        dtype the kernel writes, else None; cached per buffer because one activation writes each
        buffer many times."""
        key = id(dst)
        if key not in self._layouts:
            ok = dst.dtype in lora_cpu.ELEM_TYPES and dst.is_cpu and dst.dim() == 3 and dst.is_contiguous()
            self._layouts[key] = (dst.data_ptr(), dst.shape[1], dst.shape[2]) if ok else None
            self._buffers.append(dst)  # keeps id(dst) from being reused while cached
        return self._layouts[key]

    @staticmethod
    def _write_now(target: torch.Tensor, src: torch.Tensor | None, scale: float, transposed: bool) -> None:
        if src is None:
            target.zero_()
            return
        source = src.t() if transposed else src
        if scale == 1.0:
            target.copy_(source)
        else:
            torch.mul(source, scale, out=target)

    def flush(self) -> None:
        if self._scales:
            lora_cpu.write_blocks(self._records, self._scales)
        self._records, self._scales, self._sources = array("q"), array("f"), []
