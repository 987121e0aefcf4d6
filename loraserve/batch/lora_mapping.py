"""The per-step token -> LoRA-slot mapping, with every index each LoRA backend needs computed once.

The model runner builds one `LoRABatchMapping` per step from the slot of each token (-1 = no adapter);
every LoRA layer of every transformer layer reuses it, so per-layer work is a few tensor ops. What
each backend reads is grouped: `segments` (Triton, the C kernel, the torch GROUPED layout),
`torch_plan` (the torch ops' layout, see `lora_layout.py`), `scales` (per-request LoRA scales, in the
orders the backends read them; None when every token's scale is 1) and `cpu_kernel_args` (the C
kernel's raw pointers into `segments` and `scales`, computed here once per step instead of once per layer).

A scale is per token, not per slot: requests of one adapter at different scales share its slot and
its segment, and each token's t = A x is multiplied by its own scale before the expand.
"""

from __future__ import annotations

import ctypes
import itertools
import math
import operator
from dataclasses import dataclass

import torch

from loraserve.batch.lora_layout import (
    LoRALayout,
    PaddedLayout,
    Runs,
    padded_layout,
    padded_parts,
    pick_layout,
    token_runs,
)


@dataclass(frozen=True, slots=True)
class SlotSegments:
    """The adapter tokens grouped by slot (ascending slot, token order within a slot).

    token_ids:    [num_active_tokens] int64 token indices in slot order.
    slots:        [num_segments] int64 slot of each segment (the active slots, ascending).
    starts, lens: [num_segments] int64 each segment's place in `token_ids`.
    max_len:      the longest segment.
    """

    token_ids: torch.Tensor
    slots: torch.Tensor
    starts: torch.Tensor
    lens: torch.Tensor
    max_len: int


@dataclass(frozen=True, slots=True)
class RowScales:
    """Each adapter token's LoRA scale (float32), laid out for each reader.

    by_token:   [T, 1] in token order (tokens without an adapter: 1).
    by_segment: [num_active_tokens, 1] in `segments.token_ids` order (the C kernel, Triton, GROUPED).
    by_grid:    [num_groups, max_len, 1] for the PADDED grid (empty cells: 1), else None.
    """

    by_token: torch.Tensor
    by_segment: torch.Tensor
    by_grid: torch.Tensor | None


@dataclass(frozen=True, slots=True)
class TorchPlan:
    """How the torch ops walk the step.

    runs: (slot, start, end) token ranges for RUNS, else each active slot's segment of
          `segments.token_ids`. padded: the grid for PADDED, else None.
    """

    layout: LoRALayout
    runs: Runs
    padded: PaddedLayout | None


@dataclass(frozen=True, slots=True)
class LoRABatchMapping:
    """Which LoRA slot each of the T tokens of a step uses.

    token_slots:  [T] int64, slot per token, -1 for none (the bias lookup reads it).
    active_slots: distinct slots used, ascending; active_mask has bit s set for each (layers test it
                  against the slots they hold an adapter in).
    scales:       the tokens' LoRA scales (`RowScales`), or None when every scale is 1 (the ops then
                  multiply nothing).
    cpu_kernel_args: on CPU, the C kernel's `step` array: (token_ids, slots, starts, lens, num_segments,
                  num_active_tokens, scales) of `segments` as raw pointers and counts, then
                  `scales.by_segment`'s pointer (0 without scales); the tensors are fields here, so
                  they stay alive.
    """

    token_slots: torch.Tensor
    num_tokens: int
    num_active_tokens: int
    active_slots: tuple[int, ...]
    active_mask: int
    segments: SlotSegments
    torch_plan: TorchPlan
    cpu_kernel_args: ctypes.Array[ctypes.c_int64] | None = None
    scales: RowScales | None = None

    @property
    def has_lora(self) -> bool:
        return self.num_active_tokens > 0

    @classmethod
    def build(
        cls,
        token_slots: list[int] | torch.Tensor,
        device: torch.device | str,
        max_loras: int | None = None,
        layout: LoRALayout | None = None,
        all_slots: bool = False,
        token_scales: list[float] | None = None,
    ) -> LoRABatchMapping:
        """Index tensors for one step, built in Python (~0.1-0.2 ms for a decode batch on the dev CPU)
        and moved to `device` in one copy. `max_loras` lets the padded layout skip the weight gather
        when most slots are in use. `layout` forces one layout (tests and benchmarks); `all_slots`
        with PADDED forces the grid over all `max_loras` slots. `token_scales` (one finite float per
        token, read only for adapter tokens) scales each token's LoRA term."""
        slots = _as_slot_list(token_slots, max_loras)
        by_slot: dict[int, list[int]] = {}
        for i, slot in enumerate(slots):
            if slot >= 0:
                by_slot.setdefault(slot, []).append(i)
        active = sorted(by_slot)
        counts = [len(by_slot[s]) for s in active]
        starts = list(itertools.accumulate(counts, initial=0))[:-1]
        runs = token_runs(slots)
        chosen, use_all = pick_layout(layout, all_slots, runs, counts, max_loras)
        if chosen is not LoRALayout.RUNS:
            runs = tuple(zip(active, starts, itertools.accumulate(counts), strict=True))
        parts: list[list[int]] = [slots, active, [i for s in active for i in by_slot[s]], starts, counts]
        if chosen is LoRALayout.PADDED:
            group_slots = list(range(max_loras)) if use_all and max_loras is not None else active
            parts.extend([group_slots, *padded_parts(len(slots), by_slot, group_slots)])
        flat = torch.tensor([v for part in parts for v in part], dtype=torch.long)
        views = torch.split(flat.to(device), [len(part) for part in parts])
        padded = padded_layout(parts[5:], views[5:], len(slots), use_all) if chosen is LoRALayout.PADDED else None
        segments = SlotSegments(views[2], views[1], views[3], views[4], max(counts, default=0))
        scales = _row_scales(token_scales, slots, parts, padded, device)
        cpu_kernel_args = None
        if views[0].device.type == "cpu":
            cpu_kernel_args = (ctypes.c_int64 * 7)(segments.token_ids.data_ptr(), segments.slots.data_ptr(),
                                                   segments.starts.data_ptr(), segments.lens.data_ptr(), len(active),
                                                   sum(counts),
                                                   0 if scales is None else scales.by_segment.data_ptr())
        return cls(
            token_slots=views[0],
            num_tokens=len(slots),
            num_active_tokens=sum(counts),
            active_slots=tuple(active),
            active_mask=sum(1 << slot for slot in active),
            segments=segments,
            torch_plan=TorchPlan(chosen, runs, padded),
            cpu_kernel_args=cpu_kernel_args,
            scales=scales,
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


def _row_scales(
    token_scales: list[float] | None,
    slots: list[int],
    parts: list[list[int]],
    padded: PaddedLayout | None,
    device: torch.device | str,
) -> RowScales | None:
    """The tokens' scales in token, segment and grid order, or None when every adapter token's is 1."""
    if token_scales is None:
        return None
    if len(token_scales) != len(slots):
        raise ValueError(f"{len(token_scales)} token scales for {len(slots)} tokens")
    by_token = [float(v) if slot >= 0 else 1.0 for v, slot in zip(token_scales, slots, strict=True)]
    if all(v == 1.0 for v in by_token):
        return None
    if not all(math.isfinite(v) for v in by_token):
        raise ValueError("token scales must be finite")
    by_segment = [by_token[i] for i in parts[2]]
    lists = [by_token, by_segment]
    if padded is not None:
        lists.append([by_token[i] if i < len(slots) else 1.0 for i in parts[6]])
    flat = torch.tensor([v for part in lists for v in part], dtype=torch.float32).to(device)
    views = torch.split(flat, [len(part) for part in lists])
    grid = None
    if padded is not None:
        grid = views[2].view(padded.num_groups, padded.max_len, 1)
    return RowScales(views[0].view(-1, 1), views[1].view(-1, 1), grid)
