"""The order in which waiting sequences are offered a slot (the scheduler's admission order).

`turn_order`: requests take turns (the prompts of one API call count as one request), FCFS within a
turn, level by level under the priority policy. `by_adapter_demand`: when more adapters wait than
slots are free, the sequences that need a new slot are reordered among their own places, busiest
adapter first, except those that waited MAX_LORA_REORDER_STEPS steps.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable

from loraserve.engine.sequence import Sequence

MAX_LORA_REORDER_STEPS = 16


def turn_order(waiting: Iterable[Sequence], running: Iterable[Sequence], by_priority: bool) -> list[Sequence]:
    """Waiting sequences taking turns by request (the prompts of one API call count as one request):
    first each one's first sequence (in arrival order), then each one's second, and so on, counting
    sequences already running. A request with many sequences (prompts x n) then cannot take every
    free slot before a later one gets its turn."""
    waiting = list(waiting)
    if len({seq.request.turn_key for seq in waiting}) <= 1:
        return waiting
    taken = Counter(seq.request.turn_key for seq in running)
    ranked = []
    for position, seq in enumerate(waiting):
        key = seq.request.turn_key
        level = seq.request.priority if by_priority else 0
        ranked.append((level, taken[key], position, seq))
        taken[key] += 1
    ranked.sort(key=lambda item: (item[0], item[1], item[2]))
    return [seq for *_, seq in ranked]


def by_adapter_demand(
    order: list[Sequence], running: set[int], adapters_fit: Callable[[set[int]], bool], num_steps: int
) -> list[Sequence]:
    """`order` with its sequences that need a new slot reordered among their own places: busiest
    adapter first (by waiting requests), its sequences together, arrival order within; those that
    waited MAX_LORA_REORDER_STEPS steps first of all. Unchanged when every adapter fits the slots
    (`running`: the adapters running now)."""
    places = [i for i, seq in enumerate(order) if seq.lora_id and seq.lora_id not in running]
    wanted = running | {order[i].lora_id for i in places}
    if adapters_fit(wanted):
        return order
    demand = Counter(
        lora_id for lora_id, _ in {(order[i].lora_id, order[i].request.turn_key) for i in places}
    )
    first_place: dict[int, int] = {}
    for i in places:
        first_place.setdefault(order[i].lora_id, i)

    def rank(i: int) -> tuple[int, int, int, int]:
        seq = order[i]
        if num_steps - seq.waiting_since_step >= MAX_LORA_REORDER_STEPS:
            return (0, 0, 0, i)
        return (1, -demand[seq.lora_id], first_place[seq.lora_id], i)

    reordered = list(order)
    for place, source in zip(places, sorted(places, key=rank), strict=True):
        reordered[place] = order[source]
    return reordered
