"""The per-step token -> LoRA-slot mapping, with every index the LoRA ops need computed once.

The model runner builds one `LoRABatchMapping` per step from the slot of each token (-1 = no adapter);
every LoRA layer of every transformer layer reuses it, so per-layer work is a few tensor ops.

Three layouts of the same mapping serve the torch ops (see `ops/torch_ops.py` for measurements):
- "runs": tokens already sit in contiguous runs of one slot (the runner orders sequences by adapter),
  so each run is a plain matmul on a view of the activations; no gather, no scatter.
- "grouped": tokens are gathered into slot order once (`sorted_token_ids`), each slot's segment is a
  matmul, and the result is scattered back; used for a few adapters with interleaved tokens.
- "padded": tokens are gathered into a [groups, max_len] grid (one group per slot) so one `bmm`
  serves all adapters; used for many adapters with short segments (decode). Empty cells of the grid
  are computed but never written to a token, so a non-finite slot reaches only its own tokens.
The Triton kernels use the grouped indices (`sorted_token_ids`, `seg_starts`, `seg_lens`).
"""

from __future__ import annotations

import itertools
import operator
from dataclasses import dataclass

import torch

# Cost model: microseconds for one 576->960 plus one 576->3072 LoRA layer (fp32, r=16, 2-core AVX2
# CPU), fitted to the 1- and 2-thread measurements in ops/torch_ops.py. Per-op dispatch dominates.
_RUN_COST = 80.0  # two matmuls on a view
_GROUPED_BASE_COST = 150.0  # gather + scatter of the activations
_SEGMENT_COST = 80.0  # two matmuls per slot
_ROW_COST = 11.0  # compute per active token (runs and grouped)
_PADDED_BASE_COST = 200.0  # pad + gather + two bmm + index_add (+ select of the filled cells)
_PADDED_ROW_COST = 10.0  # compute per grid cell, empty or not
_SLOT_GATHER_COST = 50.0  # copying one slot's A and B out of the stacked buffers


@dataclass(frozen=True, slots=True)
class PaddedLayout:
    """Tokens laid out as a [num_groups, max_len] grid, one group per slot in `group_slots`.

    gather_index:  [num_groups * max_len] token index per grid cell; empty cells point at row T, a
                   zero row the op appends to its input.
    scatter_index: [T] grid cell of each token; tokens without an adapter point at an appended zero
                   row num_groups * max_len.
    filled_cells:  [num_active_tokens] the non-empty cells in grid order, or None when no cell is
                   empty. Results leave the grid through these cells only: an empty cell computes
                   0 @ W, which is NaN when its group's slot holds NaN or inf, and must reach no token.
    cell_tokens:   [num_active_tokens] the token of each non-empty cell (where `index_add_` puts it).
    uses_all_slots: group g is slot g for g in range(max_loras), so the stacked weights need no gather.
    contiguous_start: when the grid is exactly tokens [start, start + cells) in order, with no empty
                   cell (the runner sorts sequences by slot, so a balanced decode batch lands here),
                   the ops take views of the activations instead of gathering and scattering; else None.
    """

    group_slots: torch.Tensor
    gather_index: torch.Tensor
    scatter_index: torch.Tensor
    filled_cells: torch.Tensor | None
    cell_tokens: torch.Tensor
    num_groups: int
    max_len: int
    uses_all_slots: bool
    contiguous_start: int | None = None


@dataclass(frozen=True, slots=True)
class LoRABatchMapping:
    """Which LoRA slot each of the T tokens of a step uses, with precomputed grouping indices.

    token_slots:      [T] int64, slot per token, -1 for none.
    active_slots:     distinct slots used, ascending.
    sorted_token_ids: [num_active_tokens] token indices grouped by slot (ascending slot, stable).
    seg_starts/lens:  [num_active_slots] segment of each active slot inside `sorted_token_ids`.
    runs:             (slot, start, end): token ranges when `layout == "runs"`, else each active
                      slot's segment of `sorted_token_ids`.
    active_mask:      bit s set for each active slot s (layers test it against their own slots).
    kernel_args:      on CPU, the raw pointers and counts the fused C kernel takes (token_ids,
                      seg_slots, seg_starts, seg_lens, num_segs, num_active), computed once per step;
                      the tensors they point into are fields of this mapping, so they stay alive.
    """

    token_slots: torch.Tensor
    num_tokens: int
    num_active_tokens: int
    active_slots: tuple[int, ...]
    active_slots_tensor: torch.Tensor
    sorted_token_ids: torch.Tensor
    seg_starts: torch.Tensor
    seg_lens: torch.Tensor
    max_seg_len: int
    layout: str
    runs: tuple[tuple[int, int, int], ...]
    padded: PaddedLayout | None
    active_mask: int = 0
    kernel_args: tuple[int, ...] | None = None

    @property
    def has_lora(self) -> bool:
        return self.num_active_tokens > 0

    @classmethod
    def build(
        cls,
        token_slots: list[int] | torch.Tensor,
        device: torch.device | str,
        max_loras: int | None = None,
        layout: str | None = None,
    ) -> LoRABatchMapping:
        """Index tensors for one step, built in Python (~0.1-0.2 ms for a decode batch on the dev CPU)
        and moved to `device` in one copy. `max_loras` lets the padded layout skip the weight
        gather when most slots are in use. `layout` forces one layout (tests and benchmarks): "runs",
        "grouped", "padded" (grid over the active slots) or "padded_all" (grid over all `max_loras`
        slots; the mapping's `layout` is then "padded" with `padded.uses_all_slots`)."""
        slots = _as_slot_list(token_slots, max_loras)
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(i)
        active = sorted(by_slot)
        counts = [len(by_slot[s]) for s in active]
        starts = list(itertools.accumulate(counts, initial=0))[:-1]
        token_runs = _token_runs(slots)
        chosen, use_all = _pick_layout(layout, token_runs, counts, max_loras)
        ends = list(itertools.accumulate(counts))
        segments = tuple(zip(active, starts, ends, strict=True))
        runs = token_runs if chosen == "runs" else segments
        parts: list[list[int]] = [slots, active, [i for s in active for i in by_slot[s]], starts, counts]
        if chosen == "padded":
            group_slots = list(range(max_loras)) if use_all and max_loras is not None else active
            parts.extend([group_slots, *_padded_parts(len(slots), by_slot, group_slots)])
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.long)
        views = torch.split(flat.to(device), [len(part) for part in parts])
        padded = _padded_layout(parts[5:], views[5:], len(slots), use_all) if chosen == "padded" else None
        kernel_args = None
        if views[0].device.type == "cpu":
            kernel_args = (views[2].data_ptr(), views[1].data_ptr(), views[3].data_ptr(), views[4].data_ptr(),
                           len(active), sum(counts))
        return cls(
            token_slots=views[0],
            num_tokens=len(slots),
            num_active_tokens=sum(counts),
            active_slots=tuple(active),
            active_slots_tensor=views[1],
            sorted_token_ids=views[2],
            seg_starts=views[3],
            seg_lens=views[4],
            max_seg_len=max(counts, default=0),
            layout=chosen,
            runs=runs,
            padded=padded,
            active_mask=sum(1 << slot for slot in active),
            kernel_args=kernel_args,
        )


def _as_slot_list(token_slots: list[int] | torch.Tensor, max_loras: int | None) -> list[int]:
    raw = token_slots.reshape(-1).tolist() if isinstance(token_slots, torch.Tensor) else token_slots
    limit = f" and < max_loras={max_loras}" if max_loras is not None else ""
    slots: list[int] = []
    for value in raw:
        try:
            slot = operator.index(value)
        except TypeError:
            slot = -2
        if slot < -1 or (max_loras is not None and slot >= max_loras):
            raise ValueError(
                f"token slot {value!r} is invalid: slots are -1 (no adapter) or ints >= 0{limit}"
            )
        slots.append(slot)
    return slots


def _token_runs(slots: list[int]) -> tuple[tuple[int, int, int], ...]:
    """Maximal runs (slot, start, end) of equal slot >= 0 in token order."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            if slots[start] >= 0:
                runs.append((slots[start], start, i))
            start = i
    return tuple(runs)


def _padded_layout(
    lists: list[list[int]], tensors: tuple[torch.Tensor, ...], num_tokens: int, use_all: bool
) -> PaddedLayout:
    """The layout from group_slots and `_padded_parts`' lists, and the same on the device."""
    group_slots, gather, _, filled, _ = lists
    group_slots_t, gather_t, scatter_t, filled_t, cell_tokens_t = tensors
    return PaddedLayout(
        group_slots_t, gather_t, scatter_t, None if len(filled) == len(gather) else filled_t, cell_tokens_t,
        len(group_slots), len(gather) // len(group_slots), use_all, _contiguous_start(gather, num_tokens),
    )


def _contiguous_start(gather: list[int], num_tokens: int) -> int | None:
    """First token of the grid when its cells are tokens [start, start + cells) in order, else None.

    The range must end within the T tokens: an empty cell holds index T, which right after tokens
    ..., T-1 would pass for the next one, and the ops' view would then reach past the activations."""
    start = gather[0]
    if start + len(gather) > num_tokens:
        return None
    return start if gather == list(range(start, start + len(gather))) else None


def _pick_layout(
    forced: str | None, token_runs: tuple[tuple[int, int, int], ...], counts: list[int], max_loras: int | None
) -> tuple[str, bool]:
    """(layout, padded grid over all max_loras slots): `forced` if given, else the cost model's pick."""
    if forced not in (None, "runs", "grouped", "padded", "padded_all"):
        raise ValueError(f"layout must be runs, grouped, padded or padded_all, got {forced!r}")
    if forced == "padded_all" and max_loras is None:
        raise ValueError("layout='padded_all' needs max_loras")
    if not counts:
        return "runs", False  # no adapter token: the ops have nothing to do
    if forced is None:
        return _choose_layout(token_runs, counts, max_loras)
    return ("padded", True) if forced == "padded_all" else (forced, False)


def _choose_layout(
    token_runs: tuple[tuple[int, int, int], ...], counts: list[int], max_loras: int | None
) -> tuple[str, bool]:
    """(layout, padded grid over all max_loras slots) with the lowest modelled cost."""
    num_active, num_rows, max_len = len(counts), sum(counts), max(counts)
    row_cost = _ROW_COST * num_rows
    # Runs of equal length in ascending slot order: the grid is a view of the activations.
    is_grid = len(token_runs) == num_active and len(set(counts)) == 1 and all(
        a[2] == b[1] and a[0] < b[0] for a, b in zip(token_runs, token_runs[1:])
    )
    if is_grid and num_active > 1:
        use_all = max_loras is not None and num_active == max_loras
        return "padded", use_all
    costs = {
        ("runs", False): _RUN_COST * len(token_runs) + row_cost,
        ("grouped", False): _GROUPED_BASE_COST + _SEGMENT_COST * num_active + row_cost,
        ("padded", False): _PADDED_BASE_COST
        + _PADDED_ROW_COST * num_active * max_len
        + _SLOT_GATHER_COST * num_active,
    }
    if max_loras is not None:
        # The all-slot grid needs no weight gather; its empty rows still cost compute.
        costs[("padded", True)] = _PADDED_BASE_COST + _PADDED_ROW_COST * max_loras * max_len
    return min(costs, key=lambda k: costs[k])


def _padded_parts(num_tokens: int, by_slot: dict[int, list[int]], group_slots: list[int]) -> list[list[int]]:
    """gather_index, scatter_index, filled_cells and cell_tokens of the padded layout over `group_slots`."""
    max_len = max(len(v) for v in by_slot.values())
    gather = [num_tokens] * (len(group_slots) * max_len)
    scatter = [len(gather)] * num_tokens
    filled: list[int] = []
    for group, slot in enumerate(group_slots):
        for j, token in enumerate(by_slot.get(slot, ())):
            cell = group * max_len + j
            gather[cell] = token
            scatter[token] = cell
            filled.append(cell)
    return [gather, scatter, filled, [gather[cell] for cell in filled]]
