"""How the torch LoRA ops walk one step's tokens: the three layouts, the cost model that picks one,
and the padded grid's indices.

- RUNS: tokens already sit in contiguous runs of one slot (the runner orders sequences by adapter),
  so each run is a plain matmul on a view of the activations; no gather, no scatter.
- GROUPED: tokens are gathered into slot order once, each slot's segment is a matmul, and the
  result is scattered back; for a few adapters with interleaved tokens.
- PADDED: tokens are gathered into a [groups, max_len] grid (one group per slot) so one `bmm` serves
  all adapters; for many adapters with short segments (decode). Empty cells of the grid are computed
  but never written to a token, so a non-finite slot reaches only its own tokens.

The cost model's constants are fitted to the measurements in benchmarks/README.md.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch

# Microseconds for one 576->960 plus one 576->3072 LoRA layer (fp32, r=16, 2-core AVX2 CPU).
# Per-op dispatch dominates.
_RUN_COST = 80.0  # two matmuls on a view
_GROUPED_BASE_COST = 150.0  # gather + scatter of the activations
_SEGMENT_COST = 80.0  # two matmuls per slot
_ROW_COST = 11.0  # compute per active token (runs and grouped)
_PADDED_BASE_COST = 200.0  # pad + gather + two bmm + index_add (+ select of the filled cells)
_PADDED_ROW_COST = 10.0  # compute per grid cell, empty or not
_SLOT_GATHER_COST = 50.0  # copying one slot's A and B out of the stacked buffers

Runs = tuple[tuple[int, int, int], ...]  # (slot, start, end) token ranges


class LoRALayout(enum.Enum):
    RUNS = "runs"
    GROUPED = "grouped"
    PADDED = "padded"


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


def token_runs(slots: list[int]) -> Runs:
    """Maximal runs (slot, start, end) of equal slot >= 0 in token order."""
    runs: list[tuple[int, int, int]] = []
    start = 0
    for i in range(1, len(slots) + 1):
        if i == len(slots) or slots[i] != slots[start]:
            if slots[start] >= 0:
                runs.append((slots[start], start, i))
            start = i
    return tuple(runs)


def pick_layout(
    forced: LoRALayout | None, all_slots: bool, runs: Runs, counts: list[int], max_loras: int | None
) -> tuple[LoRALayout, bool]:
    """(layout, padded grid over all max_loras slots): `forced` if given, else the cheapest modelled.

    `counts` holds the token count of each active slot."""
    if all_slots and (forced is not LoRALayout.PADDED or max_loras is None):
        raise ValueError("a grid over all slots needs layout=PADDED and max_loras")
    if not counts:
        return LoRALayout.RUNS, False  # no adapter token: the ops have nothing to do
    if forced is not None:
        return forced, all_slots
    return _cheapest_layout(runs, counts, max_loras)


def _cheapest_layout(runs: Runs, counts: list[int], max_loras: int | None) -> tuple[LoRALayout, bool]:
    num_active, num_rows, max_len = len(counts), sum(counts), max(counts)
    row_cost = _ROW_COST * num_rows
    # Runs of equal length in ascending slot order: the grid is a view of the activations.
    is_grid = len(runs) == num_active and len(set(counts)) == 1 and all(
        a[2] == b[1] and a[0] < b[0] for a, b in zip(runs, runs[1:])
    )
    if is_grid and num_active > 1:
        return LoRALayout.PADDED, max_loras is not None and num_active == max_loras
    costs = {
        (LoRALayout.RUNS, False): _RUN_COST * len(runs) + row_cost,
        (LoRALayout.GROUPED, False): _GROUPED_BASE_COST + _SEGMENT_COST * num_active + row_cost,
        (LoRALayout.PADDED, False): _PADDED_BASE_COST
        + _PADDED_ROW_COST * num_active * max_len
        + _SLOT_GATHER_COST * num_active,
    }
    if max_loras is not None:
        # The all-slot grid needs no weight gather; its empty rows still cost compute.
        costs[(LoRALayout.PADDED, True)] = _PADDED_BASE_COST + _PADDED_ROW_COST * max_loras * max_len
    return min(costs, key=lambda k: costs[k])


def padded_parts(num_tokens: int, by_slot: dict[int, list[int]], group_slots: list[int]) -> list[list[int]]:
    """gather_index, scatter_index, filled_cells and cell_tokens of the grid over `group_slots`."""
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


def padded_layout(
    lists: list[list[int]], tensors: tuple[torch.Tensor, ...], num_tokens: int, use_all: bool
) -> PaddedLayout:
    """The layout from group_slots and `padded_parts`' lists, and the same on the device."""
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
