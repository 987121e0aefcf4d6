"""The K-quants' (Q4_K, Q5_K, Q6_K) panel layouts: a weight's rows packed at load in panels of 8, read by
native/kernels/quant_kernel_kpacked.h for every row count of x.

Per super-block (256 weights) of a panel's 8 rows, in order:
- each quant field of the file's block in steps: step t is bytes 4t .. 4t + 3 of the field in rows 0-7
  (one 32-byte load feeds a 4-byte broadcast of x against 8 rows); Q4_K's nibble bytes, Q5_K's nibble
  bytes then its high-bit bytes, Q6_K's low-nibble bytes then its two-bit bytes;
- the sub-block scales as bytes [scale][row]: Q4_K / Q5_K's 8 six-bit scales then their 8 mins (the
  file's 12 packed bytes spread to 16), Q6_K's 16 int8 scales;
- the rows' float16 fields [field][row]: d (and Q4_K / Q5_K's dmin).
So a row takes 148 / 180 / 210 bytes a super-block against the file's 144 / 176 / 210.
"""

from __future__ import annotations

import torch

# format: (its block's bytes, the quant fields' byte ranges in the file's block, the float16 fields'
# offsets); the scale bytes sit at 4-16 (Q4_K, Q5_K) or 192-208 (Q6_K)
_FIELDS: dict[str, tuple[int, tuple[tuple[int, int], ...], tuple[int, ...]]] = {
    "Q4_K": (144, ((16, 144),), (0, 2)),
    "Q5_K": (176, ((48, 176), (16, 48)), (0, 2)),
    "Q6_K": (210, ((0, 128), (128, 192)), (208,)),
}
K_PANEL_FORMATS = frozenset(_FIELDS)


def k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Q4_K/Q5_K's 12 scale bytes -> (8 six-bit scales, 8 six-bit mins) per block, as int."""
    s = scales.reshape(-1, 3, 4).int()
    d, m, md = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat([d & 63, (md & 15) | ((d >> 2) & 48)], dim=-1)
    mn = torch.cat([m & 63, (md >> 4) | ((m >> 2) & 48)], dim=-1)
    return sc, mn


def k_scale_bytes(sc: torch.Tensor, mn: torch.Tensor) -> torch.Tensor:
    """`k_scales` undone: 8 scales and 8 mins [..., 8] (int) -> the 12 packed bytes [..., 12]."""
    low = [(v[..., :4] & 63) | ((v[..., 4:] >> 4) << 6) for v in (sc, mn)]
    return torch.cat([*low, (sc[..., 4:] & 15) | ((mn[..., 4:] & 15) << 4)], -1).to(torch.uint8)


def _scales(name: str, b: torch.Tensor) -> list[torch.Tensor]:
    """The scale bytes of blocks b [..., 8 rows, block bytes], each [..., 8 rows, count] uint8."""
    if name == "Q6_K":
        return [b[..., 192:208]]
    sc, mn = k_scales(b[..., 4:16].reshape(-1, 12))
    return [v.reshape(*b.shape[:-1], 8).to(torch.uint8) for v in (sc, mn)]


def pack_k(blocks: torch.Tensor, name: str, out: int, inp: int) -> torch.Tensor:
    """`name`'s file blocks [out, row bytes] as panels [out / 8, 8 * panel row bytes] (the layout above)."""
    size, quants, halves = _FIELDS[name]
    panels, nsb = out // 8, inp // 256
    b = blocks.reshape(panels, 8, nsb, size).transpose(1, 2)  # [panel, super-block, row, byte]
    parts = [
        b[..., lo:hi].reshape(panels, nsb, 8, (hi - lo) // 4, 4).transpose(2, 3).reshape(panels, nsb, -1)
        for lo, hi in quants
    ]
    parts += [s.transpose(2, 3).reshape(panels, nsb, -1) for s in _scales(name, b)]
    parts += [b[..., f : f + 2].reshape(panels, nsb, 16) for f in halves]
    return torch.cat(parts, dim=2).reshape(panels, -1).contiguous()


def unpack_k(blocks: torch.Tensor, name: str, out: int, inp: int, rows: torch.Tensor) -> torch.Tensor:
    """Rows `rows` of `name`'s panels as the file's blocks [rows, row bytes] (`pack_k` undone)."""
    size, quants, halves = _FIELDS[name]
    nsb = inp // 256
    b = blocks.reshape(out // 8, nsb, -1)
    panel, lane = rows // 8, rows % 8
    at, fields = 0, {}
    for lo, hi in quants:  # [rows, super-block, steps, 4]
        steps = b[..., at : at + 8 * (hi - lo)].reshape(out // 8, nsb, (hi - lo) // 4, 8, 4)
        fields[lo], at = steps[panel, :, :, lane].reshape(rows.numel(), nsb, hi - lo), at + 8 * (hi - lo)
    scales = []
    for count in (16,) if name == "Q6_K" else (8, 8):
        scales.append(b[..., at : at + 8 * count].reshape(out // 8, nsb, count, 8)[panel, :, :, lane])
        at += 8 * count
    for f in halves:
        fields[f], at = b[..., at : at + 16].reshape(out // 8, nsb, 8, 2)[panel, :, lane], at + 16
    if name == "Q6_K":
        fields[192] = scales[0]
    else:
        fields[4] = k_scale_bytes(scales[0].int(), scales[1].int())
    row = torch.cat([fields[start] for start in sorted(fields)], dim=2)
    assert row.shape[2] == size
    return row.reshape(rows.numel(), nsb * size)
