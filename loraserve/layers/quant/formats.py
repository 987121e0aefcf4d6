"""GGUF's block-quantized weight formats: their byte layouts, a torch dequantizer (the twin of the C
kernels and their oracle's source) and the float64 reference product.

A quantized [out, in] weight is `out` rows of `in / block_size` blocks, each block `type_size` bytes,
stored row after row (`QuantTensor.blocks`, uint8 [out, row_bytes]). Every block holds one or more
scales and small integers; `dequantize` reads them as gguf.quants does (the layouts' source of truth,
tests/layers/quant checks the two agree). In the kernels every format is read 32 weights at a time:
    value = scale(half) * q + add,  q a signed or unsigned byte, `scale` one per 16 weights (Q6_K) or 32
so one integer dot product with 32 quantized activations serves every format.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from loraserve.layers.quant.kpanels import K_PANEL_FORMATS, k_scales, pack_k, unpack_k


@dataclass(frozen=True, slots=True)
class QuantType:
    """One block format: `ggml_type` is GGML's enum value (GGUF's tensor type), `code` the kernels'.
    A row-layout type (`rows_of` names its GGUF format) holds the same bytes per row, reordered for the
    decode kernel (see `repack_rows`); a panel type (`panels_of`) the same bytes per 8 rows, interleaved
    (see `repack_panels`). Both exist only in memory."""

    name: str
    ggml_type: int
    block_size: int
    type_size: int
    code: int
    rows_of: str | None = None
    panels_of: str | None = None

    @property
    def source(self) -> str:
        """The GGUF format whose bytes this layout holds."""
        return self.rows_of or self.panels_of or self.name


QUANT_TYPES: dict[str, QuantType] = {
    t.name: t
    for t in (
        QuantType("Q8_0", 8, 32, 34, 0),
        QuantType("Q4_0", 2, 32, 18, 1),
        QuantType("Q4_1", 3, 32, 20, 2),
        QuantType("Q4_K", 12, 256, 144, 3),
        QuantType("Q5_K", 13, 256, 176, 4),
        QuantType("Q6_K", 14, 256, 210, 5),
    )
}
def _by_source(*layouts: QuantType) -> dict[str, QuantType]:
    """In-memory layouts by the GGUF format whose bytes they hold."""
    return {t.source: t for t in layouts}


# The row layouts of the per-32 formats (`repack_rows`).
ROW_TYPES = _by_source(
    QuantType("Q8_0R", 8, 32, 34, 6, rows_of="Q8_0"),
    QuantType("Q4_0R", 2, 32, 18, 7, rows_of="Q4_0"),
    QuantType("Q4_1R", 3, 32, 20, 8, rows_of="Q4_1"),
)
# The panel layouts (`repack_panels`); Q4_K's and Q5_K's rows take 4 bytes more a super-block than the
# file's: their 12 packed scale bytes spread to 16 (kpanels.py).
PANEL_TYPES = _by_source(
    QuantType("Q8_0P", 8, 32, 34, 9, panels_of="Q8_0"),
    QuantType("Q4_0P", 2, 32, 18, 10, panels_of="Q4_0"),
    QuantType("Q4_1P", 3, 32, 20, 11, panels_of="Q4_1"),
    QuantType("Q4_KP", 12, 256, 148, 12, panels_of="Q4_K"),
    QuantType("Q5_KP", 13, 256, 180, 13, panels_of="Q5_K"),
    QuantType("Q6_KP", 14, 256, 210, 14, panels_of="Q6_K"),
)


@dataclass(frozen=True, slots=True)
class QuantTensor:
    """A quantized [out, in] weight as the checkpoint stores it: `blocks` uint8 [out, in / block_size *
    type_size] (rows may be permuted or sliced as whole rows: blocks never cross a row); a panel layout's
    are [out / 8, 8 * row bytes] (sliced by whole panels only)."""

    blocks: torch.Tensor
    qtype: QuantType
    shape: tuple[int, int]

    def __post_init__(self) -> None:
        out, inp = self.shape
        if inp % self.qtype.block_size:
            raise ValueError(
                f"{self.qtype.name} needs rows of a multiple of {self.qtype.block_size}, got {inp}"
            )
        row_bytes = inp // self.qtype.block_size * self.qtype.type_size
        want = (out, row_bytes) if self.qtype.panels_of is None else (out // 8, 8 * row_bytes)
        if self.qtype.panels_of is not None and out % 8:
            raise ValueError(f"{self.qtype.name} holds panels of 8 rows, got {out} rows")
        if self.blocks.dtype != torch.uint8 or tuple(self.blocks.shape) != want:
            raise ValueError(
                f"{self.qtype.name} [{out}, {inp}] needs uint8 blocks {want}, "
                f"got {self.blocks.dtype} {tuple(self.blocks.shape)}"
            )

    @property
    def nbytes(self) -> int:
        return self.blocks.numel()

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        return dequantize(self.blocks, self.qtype, self.shape).to(dtype)


def _f16(b: torch.Tensor, at: int) -> torch.Tensor:
    """The float16 at byte `at` of every block, as float32 [blocks, 1]."""
    return b[:, at : at + 2].contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, groups: int) -> torch.Tensor:
    """Bytes [blocks, groups * 32] -> [blocks, 2 * groups, 32]: each 32-byte group's low nibbles, then
    its high nibbles (the K-quants' order)."""
    q = qs.reshape(qs.shape[0], groups, 1, 32) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
    return (q & 15).reshape(qs.shape[0], 2 * groups, 32)


def _dequantize_blocks(b: torch.Tensor, name: str) -> torch.Tensor:
    """uint8 [blocks, type_size] -> float32 [blocks, block_size]."""
    n = b.shape[0]
    if name == "Q8_0":
        return _f16(b, 0) * b[:, 2:].contiguous().view(torch.int8).float()
    if name in ("Q4_0", "Q4_1"):
        start = 2 if name == "Q4_0" else 4
        qs = b[:, start : start + 16]
        q = torch.cat([qs & 15, qs >> 4], dim=-1).float()
        return _f16(b, 0) * (q - 8) if name == "Q4_0" else _f16(b, 0) * q + _f16(b, 2)
    if name in ("Q4_K", "Q5_K"):
        sc, mn = k_scales(b[:, 4:16])
        scale = (_f16(b, 0) * sc.float()).unsqueeze(-1)
        minimum = (_f16(b, 2) * mn.float()).unsqueeze(-1)
        if name == "Q4_K":
            q = _nibbles(b[:, 16:144], 4).float()
        else:
            bits = torch.arange(8, dtype=torch.uint8).view(1, 8, 1)
            high = (b[:, 16:48].reshape(n, 1, 32) >> bits) & 1
            q = (_nibbles(b[:, 48:176], 4) | (high << 4)).float()
        return (scale * q - minimum).reshape(n, 256)
    if name == "Q6_K":
        low = (
            b[:, :128].reshape(n, 2, 1, 64) >> torch.tensor([0, 4], dtype=torch.uint8).view(1, 1, 2, 1)
        ) & 15
        shifts = torch.tensor([0, 2, 4, 6], dtype=torch.uint8).view(1, 1, 4, 1)
        high = (b[:, 128:192].reshape(n, 2, 1, 32) >> shifts) & 3
        q = (low.reshape(n, 8, 32) | (high.reshape(n, 8, 32) << 4)).float() - 32
        scale = _f16(b, 208) * b[:, 192:208].contiguous().view(torch.int8).float()
        return (scale.unsqueeze(-1) * q.reshape(n, 16, 16)).reshape(n, 256)
    raise ValueError(f"unknown quantization type {name}")


def dequantize(blocks: torch.Tensor, qtype: QuantType, shape: tuple[int, int]) -> torch.Tensor:
    """The float32 [out, in] weight that `blocks` (uint8 [out, row_bytes]) encode in `qtype`."""
    out, inp = shape
    if qtype.rows_of is not None:
        blocks, qtype = unpack_rows(blocks, qtype, inp), QUANT_TYPES[qtype.rows_of]
    elif qtype.panels_of is not None:
        blocks, qtype = panel_rows(blocks, qtype, shape), QUANT_TYPES[qtype.panels_of]
    flat = blocks.reshape(-1, qtype.type_size)
    return _dequantize_blocks(flat, qtype.name).reshape(out, inp)


def _row_fields(qtype: QuantType) -> tuple[int, int]:
    """(bytes of float16 fields, bytes of quants) per block of a per-32 format."""
    fields = 4 if qtype.name.startswith("Q4_1") else 2
    return fields, qtype.type_size - fields


def file_blocks(tensor: QuantTensor) -> QuantTensor:
    """`tensor` in its GGUF format's own block layout (a row or panel layout undone)."""
    qtype = tensor.qtype
    if qtype.rows_of is not None:
        return QuantTensor(unpack_rows(tensor.blocks, qtype, tensor.shape[1]), QUANT_TYPES[qtype.source], tensor.shape)
    if qtype.panels_of is not None:
        return QuantTensor(panel_rows(tensor.blocks, qtype, tensor.shape), QUANT_TYPES[qtype.source], tensor.shape)
    return tensor


def repack_panels(tensor: QuantTensor) -> QuantTensor:
    """Q8_0 / Q4_0 / Q4_1 / Q4_K / Q5_K / Q6_K (in any layout) in panels of 8 rows, the same bytes per 8
    rows (any other tensor, or one whose rows are not a multiple of 8, as it is; the K-quants' layout is
    kpanels.py's). Per panel, per 32-block: the 8 rows'
    quants interleaved 4 bytes at a time (step t: bytes 4t .. 4t + 3 of row 0, then of row 1, ...: Q8_0's
    32 quant bytes make 8 steps, Q4_x's 16 nibble bytes 4, each byte's low nibble weight j and high
    nibble j + 16 as in the file), then the 8 float16 scales, then Q4_1's 8 mins
    (native/kernels/quant_kernel_packed.h reads them)."""
    panel_type = PANEL_TYPES.get(tensor.qtype.source)
    out, inp = tensor.shape
    if panel_type is None or tensor.qtype == panel_type or out % 8:
        return tensor
    source = QUANT_TYPES[tensor.qtype.source]
    if source.name in K_PANEL_FORMATS:
        return QuantTensor(pack_k(file_blocks(tensor).blocks, source.name, out, inp), panel_type, tensor.shape)
    fields, qbytes = _row_fields(source)
    nb = inp // 32
    b = file_blocks(tensor).blocks.reshape(out // 8, 8, nb, source.type_size).transpose(1, 2)
    steps = b[..., fields:].reshape(out // 8, nb, 8, qbytes // 4, 4).transpose(2, 3)
    parts = [steps.reshape(out // 8, nb, 8 * qbytes)]
    parts += [b[..., f : f + 2].reshape(out // 8, nb, 16) for f in range(0, fields, 2)]
    packed = torch.cat(parts, dim=2).reshape(out // 8, nb * 8 * source.type_size)
    return QuantTensor(packed.contiguous(), panel_type, tensor.shape)


def panel_rows(
    blocks: torch.Tensor, qtype: QuantType, shape: tuple[int, int], rows: torch.Tensor | None = None
) -> torch.Tensor:
    """Rows `rows` (all when None) of a panel layout's blocks in their GGUF format's blocks [rows,
    row_bytes] (`repack_panels` undone; an embedding gathers its tokens' rows so)."""
    source = QUANT_TYPES[qtype.source]
    out, inp = shape
    if rows is None:
        rows = torch.arange(out)
    if source.name in K_PANEL_FORMATS:
        return unpack_k(blocks, source.name, out, inp, rows)
    fields, qbytes = _row_fields(source)
    nb = inp // 32
    b = blocks.reshape(out // 8, nb, 8 * source.type_size)
    panel, lane = rows // 8, rows % 8
    steps = b[..., : 8 * qbytes].reshape(out // 8, nb, qbytes // 4, 8, 4)[panel, :, :, lane]
    parts = [
        b[..., 8 * qbytes + 8 * f : 8 * qbytes + 8 * (f + 2)].reshape(out // 8, nb, 8, 2)[panel, :, lane]
        for f in range(0, fields, 2)
    ]
    parts.append(steps.reshape(rows.numel(), nb, qbytes))
    return torch.cat(parts, dim=2).reshape(rows.numel(), nb * source.type_size)


def repack_rows(tensor: QuantTensor) -> QuantTensor:
    """Q8_0 / Q4_0 / Q4_1 in their row layout (any other tensor as it is), the same bytes per row:
    the row's float16 scales (nb of them), then Q4_1's mins, then the quants, so the decode kernel reads
    8 blocks' scales in one load and two blocks' quants in one 256-bit register. Quants of a pair of
    blocks (b, b + 1) go as: Q4_x, b's 16 nibble bytes then b + 1's (a register's low nibbles are then
    weights 0-15 of b and of b + 1, its high ones 16-31); Q8_0, b's bytes 0-15, b + 1's 0-15, b's 16-31,
    b + 1's 16-31 (the same order). An odd row's last block keeps its own order. The activations are
    permuted to match (the kernel's quantize_x)."""
    row_type = ROW_TYPES.get(tensor.qtype.source)
    if row_type is None or tensor.qtype == row_type:
        return tensor
    tensor = file_blocks(tensor)
    out, inp = tensor.shape
    nb = inp // 32
    fields, qbytes = _row_fields(tensor.qtype)
    b = tensor.blocks.reshape(out, nb, tensor.qtype.type_size)
    scales = b[:, :, :fields].reshape(out, nb, fields // 2, 2).transpose(1, 2).reshape(out, nb * fields)
    quants = b[:, :, fields:]
    if qbytes == 32:  # Q8_0: pairs interleaved by halves
        even = nb // 2 * 2
        pairs = quants[:, :even].reshape(out, nb // 2, 2, 2, 16).transpose(2, 3).reshape(out, even * 32)
        quants = torch.cat([pairs, quants[:, even:].reshape(out, -1)], dim=1)
    rows = torch.cat([scales, quants.reshape(out, nb * qbytes)], dim=1).contiguous()
    return QuantTensor(rows, row_type, tensor.shape)


def unpack_rows(blocks: torch.Tensor, qtype: QuantType, inp: int) -> torch.Tensor:
    """The GGUF blocks [rows, row_bytes] of `qtype`'s row layout (`repack_rows` undone)."""
    source = QUANT_TYPES[qtype.rows_of or qtype.name]
    rows, nb = blocks.shape[0], inp // 32
    fields, qbytes = _row_fields(source)
    scales = (
        blocks[:, : nb * fields].reshape(rows, fields // 2, nb, 2).transpose(1, 2).reshape(rows, nb, fields)
    )
    quants = blocks[:, nb * fields :]
    if qbytes == 32:
        even = nb // 2 * 2
        pairs = (
            quants[:, : even * 32].reshape(rows, nb // 2, 2, 2, 16).transpose(2, 3).reshape(rows, even, 32)
        )
        quants = torch.cat([pairs, quants[:, even * 32 :].reshape(rows, -1, 32)], dim=1)
    return torch.cat([scales, quants.reshape(rows, nb, qbytes)], dim=2).reshape(rows, nb * source.type_size)


def reference_linear(x: torch.Tensor, weight: QuantTensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x W^T + b in float64 with W the exact dequantized weight: the kernels' test oracle."""
    y = x.double() @ weight.dequantize(torch.float64).T
    return y if bias is None else y + bias.double()


def quantize_q8_0(weight: torch.Tensor) -> QuantTensor:
    """A float [out, in] weight (in a multiple of 32) as Q8_0: per 32 weights a float16 scale amax/127
    and round-to-nearest int8s, the on-load int8 of a float checkpoint (and the same bytes
    gguf.quants.quantize writes, up to its rounding of halves)."""
    out, inp = weight.shape
    if inp % 32:
        raise ValueError(f"Q8_0 needs rows of a multiple of 32 weights, got {inp}")
    w = weight.detach().float().reshape(out, inp // 32, 32)
    d = (w.abs().amax(-1, keepdim=True) / 127).to(torch.float16)
    inv = torch.where(d == 0, torch.zeros_like(d, dtype=torch.float32), 1 / d.float())
    q = torch.round(w * inv).clamp(-127, 127).to(torch.int8)
    blocks = torch.cat([d.view(torch.uint8), q.view(torch.uint8)], dim=-1).reshape(out, -1)
    return QuantTensor(blocks.contiguous(), QUANT_TYPES["Q8_0"], (out, inp))
