"""Multi-LoRA shrink/expand in plain torch (CPU, and CUDA without Triton).

No op gathers a weight matrix per token: tokens are grouped by slot using the step's
`LoRABatchMapping`, whose layout (runs / grouped / padded, `batch/lora_layout.py`) was chosen once per step.
Per-op dispatch (~10-30 us for a small matmul) dominates on CPU, hence one matmul per run, per slot
or one bmm for all slots; the measurements behind the choice are in benchmarks/README.md.
A step with per-request scales (`mapping.scales`) multiplies each token's row of t = A x by its
scale (one more op per shrink, in the layout's order); a step without them runs no extra op.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from loraserve.batch.lora_layout import LoRALayout, PaddedLayout
from loraserve.batch.lora_mapping import LoRABatchMapping


def lora_shrink(
    x: torch.Tensor, a_stacked: torch.Tensor, mapping: LoRABatchMapping, scale: float = 1.0
) -> torch.Tensor:
    """Semantics: t[i] = scale * c_i * a_stacked[s_i] @ x[i] for tokens with slot s_i >= 0, else 0, with
    c_i the token's scale (`mapping.scales.by_token`, 1 without); row i reads only slot s_i's weights,
    so a non-finite slot reaches only its own tokens' rows.

    Shape: x [T, in]; a_stacked [L, R, in] (any strides); returns t [T, R] in x's dtype.
    """
    num_tokens, rank = x.shape[0], a_stacked.shape[1]
    plan = mapping.torch_plan
    if plan.padded is not None:
        pad = plan.padded
        tp = torch.bmm(_gather_padded(x, pad), _slot_weights(a_stacked, pad).transpose(1, 2))
        t = _scatter_padded(tp.reshape(-1, rank), pad)
    else:
        t = x.new_zeros(num_tokens, rank)
        if plan.layout is LoRALayout.RUNS:
            for slot, start, end in plan.runs:
                torch.mm(x[start:end], a_stacked[slot].t(), out=t[start:end])
        else:
            token_ids = mapping.segments.token_ids
            xs = x.index_select(0, token_ids)
            ts = torch.empty(xs.shape[0], rank, dtype=x.dtype, device=x.device)
            for slot, start, end in plan.runs:
                torch.mm(xs[start:end], a_stacked[slot].t(), out=ts[start:end])
            t.index_copy_(0, token_ids, ts)
    if mapping.scales is not None:
        t.mul_(mapping.scales.by_token)
    if scale != 1.0:
        t.mul_(scale)
    return t


def lora_expand(
    y: torch.Tensor, t: torch.Tensor, b_stacked: torch.Tensor, mapping: LoRABatchMapping, offset: int = 0
) -> torch.Tensor:
    """Semantics: y[i, offset:offset+out] += b_stacked[s_i] @ t[i] for tokens with slot s_i >= 0;
    returns y. Rows of t for tokens without an adapter are ignored and their rows of y are left
    bit-for-bit alone; row i reads only slot s_i's weights (a NaN slot reaches only its own tokens).

    Shape: y [T, >= offset+out] (updated in place); t [T, R]; b_stacked [L, out, R] (any strides;
    stored as a [L, R, out] buffer transposed, its transpose is contiguous, which `bmm` runs fastest).
    """
    out_features = b_stacked.shape[1]
    target = y[:, offset : offset + out_features]
    plan = mapping.torch_plan
    if plan.padded is not None:
        pad = plan.padded
        tp = _gather_padded(t, pad)
        yp = torch.bmm(tp, _slot_weights(b_stacked, pad).transpose(1, 2))
        target.index_add_(0, pad.cell_tokens, _filled_rows(yp, pad))
    elif plan.layout is LoRALayout.RUNS:
        for slot, start, end in plan.runs:
            target[start:end].addmm_(t[start:end], b_stacked[slot].t())
    else:
        token_ids = mapping.segments.token_ids
        ts = t.index_select(0, token_ids)
        ys = torch.empty(ts.shape[0], out_features, dtype=y.dtype, device=y.device)
        for slot, start, end in plan.runs:
            torch.mm(ts[start:end], b_stacked[slot].t(), out=ys[start:end])
        target.index_add_(0, token_ids, ys)
    return y


def add_lora(
    y: torch.Tensor,
    x: torch.Tensor,
    a_stacked: torch.Tensor,
    b_stacked: torch.Tensor,
    mapping: LoRABatchMapping,
    offset: int = 0,
) -> torch.Tensor:
    """Semantics: y[i, offset:offset+out] += b_stacked[s_i] @ (c_i * a_stacked[s_i] @ x[i]) for tokens
    with slot s_i >= 0 (c_i the token's scale, 1 without), i.e.
    `lora_expand(y, lora_shrink(x, a, m), b, m, offset)` with the same isolation;
    the intermediate stays in the mapping's layout (no scatter/gather between the two matmuls),
    which saves 3-4 ops per layer.

    Shape: y [T, >= offset+out] (updated in place, returned); x [T, in]; a_stacked [L, R, in];
    b_stacked [L, out, R].
    """
    out_features = b_stacked.shape[1]
    target = y[:, offset : offset + out_features]
    plan, scales = mapping.torch_plan, mapping.scales
    if plan.padded is not None:
        pad = plan.padded
        tp = torch.bmm(_gather_padded(x, pad), _slot_weights(a_stacked, pad).transpose(1, 2))
        if scales is not None:
            assert scales.by_grid is not None
            tp.mul_(scales.by_grid)
        b_t = _slot_weights(b_stacked, pad).transpose(1, 2)
        if pad.contiguous_start is not None:
            start = pad.contiguous_start
            grid = target[start : start + pad.num_groups * pad.max_len]
            if grid.is_contiguous():
                grid.view(pad.num_groups, pad.max_len, out_features).baddbmm_(tp, b_t)
            else:
                grid.add_(torch.bmm(tp, b_t).view(grid.shape))
        else:
            target.index_add_(0, pad.cell_tokens, _filled_rows(torch.bmm(tp, b_t), pad))
    elif plan.layout is LoRALayout.RUNS:
        for slot, start, end in plan.runs:
            t = F.linear(x[start:end], a_stacked[slot])
            if scales is not None:
                t.mul_(scales.by_token[start:end])
            target[start:end].addmm_(t, b_stacked[slot].t())
    else:
        token_ids = mapping.segments.token_ids
        xs = x.index_select(0, token_ids)
        ys = torch.empty(xs.shape[0], out_features, dtype=y.dtype, device=y.device)
        for slot, start, end in plan.runs:
            t = F.linear(xs[start:end], a_stacked[slot])
            if scales is not None:
                t.mul_(scales.by_segment[start:end])
            torch.mm(t, b_stacked[slot].t(), out=ys[start:end])
        target.index_add_(0, token_ids, ys)
    return y


def _gather_padded(rows: torch.Tensor, pad: PaddedLayout) -> torch.Tensor:
    """Semantics: the grid of `rows`; empty cells read an appended zero row.

    Shape: rows [T, d] -> [groups, max_len, d]."""
    if pad.contiguous_start is not None:
        start = pad.contiguous_start
        grid = rows[start : start + pad.num_groups * pad.max_len]
        return grid.reshape(pad.num_groups, pad.max_len, rows.shape[1])
    padded = F.pad(rows, (0, 0, 0, 1)).index_select(0, pad.gather_index)
    return padded.view(pad.num_groups, pad.max_len, rows.shape[1])


def _filled_rows(grid: torch.Tensor, pad: PaddedLayout) -> torch.Tensor:
    """Semantics: the rows of the grid's non-empty cells, in `pad.cell_tokens` order. An empty cell
    holds 0 @ W, which is NaN when its slot's weights hold NaN or inf (0 * inf), so it must never be
    added to a token; the select costs one op, and only for grids with empty cells.

    Shape: grid [groups, max_len, d] -> [num_active_tokens, d]."""
    rows = grid.reshape(-1, grid.shape[-1])
    return rows if pad.filled_cells is None else rows.index_select(0, pad.filled_cells)


def _scatter_padded(cells: torch.Tensor, pad: PaddedLayout) -> torch.Tensor:
    """Semantics: each token's grid row; tokens without an adapter read an appended zero row.

    Shape: cells [groups * max_len, d] -> [T, d]."""
    return F.pad(cells, (0, 0, 0, 1)).index_select(0, pad.scatter_index)


def _slot_weights(stacked: torch.Tensor, pad: PaddedLayout) -> torch.Tensor:
    if pad.uses_all_slots and stacked.shape[0] == pad.num_groups:
        return stacked
    if stacked.transpose(1, 2).is_contiguous():
        # Gather in the storage layout: whole contiguous blocks instead of a transposing copy.
        return stacked.transpose(1, 2).index_select(0, pad.group_slots).transpose(1, 2)
    return stacked.index_select(0, pad.group_slots)
