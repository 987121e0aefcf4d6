"""`SlotTable`: which adapter sits in which of the `max_loras` compute slots, and the slot writes.

The slots are rows of every wrapped layer's buffers. Occupied slots form an LRU; a miss takes a free
slot or evicts the least recently used adapter that is neither pinned nor kept (used by the step).
At most max_loras - 1 adapters can be pinned, so that other adapters can still run. An adapter is
written into a slot with one batched write over all layers (`BlockWriter`); a write that a layer
refuses leaves the slot zeroed and free. Not thread-safe: `LoRAManager` holds its lock around calls.
"""

from __future__ import annotations

import logging
from collections.abc import Collection, Mapping
from dataclasses import dataclass

from loraserve.lora.layers import SlotLayer
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.lru import LRUCache
from loraserve.lora.ops.block_writer import BlockWriter

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SlotCounters:
    """Monotonic counters for metrics."""

    num_slot_hits: int = 0  # the adapter was already in a slot
    num_slot_loads: int = 0  # adapter written into a slot
    num_slot_evictions: int = 0


class SlotTable:
    def __init__(self, layers: Mapping[str, SlotLayer], max_loras: int) -> None:
        self.layers = layers
        self.max_loras = max_loras
        self.counters = SlotCounters()
        self._slots: LRUCache[int, int] = LRUCache(max_loras, self._evicted)  # lora_id -> slot
        self._free = set(range(max_loras))
        self._pinned: set[int] = set()

    @property
    def num_used(self) -> int:
        return len(self._slots)

    @property
    def has_free(self) -> bool:
        return bool(self._free)

    @property
    def pinned_ids(self) -> frozenset[int]:
        return frozenset(self._pinned)

    def slot_of(self, lora_id: int) -> int | None:
        return self._slots.peek(lora_id)

    def check_consistency(self) -> str | None:
        """What is wrong with the slot bookkeeping; None if every slot is either free or held by one
        adapter and every pinned adapter holds one."""
        used = [slot for _, slot in self._slots.items()]
        if len(set(used)) != len(used) or set(used) & self._free:
            return f"LoRA slots are held twice or both held and free: held {sorted(used)}, free {sorted(self._free)}"
        if set(used) | self._free != set(range(self.max_loras)):
            return f"LoRA slots are lost: held {sorted(used)}, free {sorted(self._free)}"
        if not self._pinned <= set(self._slots.keys()):
            return "a pinned LoRA adapter holds no slot"
        return None

    def can_fit(self, lora_ids: Collection[int]) -> bool:
        """Whether `lora_ids` can all hold a slot at once (slots pinned by others stay taken)."""
        pinned_elsewhere = len(self._pinned.difference(lora_ids))
        return len(lora_ids) <= self.max_loras - pinned_elsewhere

    def acquire(self, lora_model: LoRAModel, keep: Collection[int]) -> int:
        """The adapter's slot, written into a free or least recently used one if needed (never
        evicting a pinned adapter or one in `keep`); now the most recently used."""
        lora_id = lora_model.lora_id
        slot = self._slots.get(lora_id)
        if slot is not None:
            self.counters.num_slot_hits += 1
            return slot
        if not self._free:
            victim = self._slots.victim(self._pinned.union(keep))
            if victim is None:
                raise ValueError(
                    f"no free LoRA slot for adapter '{lora_model.name}': all max_loras={self.max_loras} "
                    "slots hold pinned adapters or adapters of the running step"
                )
            self._slots.evict(victim)
        return self._write(lora_model, min(self._free))

    def place_if_free(self, lora_model: LoRAModel) -> None:
        """Write a freshly loaded adapter into a free slot, if there is one; never evicts (a running
        step uses the other slots)."""
        if lora_model.lora_id not in self._slots and self._free:
            self._write(lora_model, min(self._free))

    def pin(self, lora_model: LoRAModel, keep: Collection[int]) -> bool:
        """Keep the adapter in a slot until `release`; False if already pinned."""
        lora_id = lora_model.lora_id
        if lora_id in self._pinned:
            return False
        if len(self._pinned) + 1 >= self.max_loras:
            raise ValueError(
                f"cannot pin LoRA adapter '{lora_model.name}': {len(self._pinned)} adapters are pinned "
                f"and max_loras={self.max_loras}; pinning every slot would leave none for other "
                "adapters (at most max_loras - 1 can be pinned)"
            )
        self.acquire(lora_model, keep)
        self._pinned.add(lora_id)
        return True

    def unpin(self, lora_id: int) -> bool:
        """The adapter keeps its slot but may be evicted again; False if it was not pinned."""
        if lora_id not in self._pinned:
            return False
        self._pinned.discard(lora_id)
        return True

    def release(self, lora_id: int) -> None:
        """The adapter leaves its slot (zeroed) and its pin."""
        self._pinned.discard(lora_id)
        slot = self._slots.pop(lora_id)
        if slot is not None:
            self._clear(slot)

    def _evicted(self, lora_id: int, slot: int) -> None:
        self._free.add(slot)
        self.counters.num_slot_evictions += 1

    def _write(self, lora_model: LoRAModel, slot: int) -> int:
        """Put the adapter in every layer's `slot` (layers it does not touch are cleared) in one
        batched write. If a layer refuses its weights, the writes recorded so far are flushed first,
        so every layer's buffers match the ranks it recorded, then the slot is zeroed, left free, and
        the error propagates."""
        self._free.discard(slot)
        writer = BlockWriter()
        try:
            try:
                for name, layer in self.layers.items():
                    weights = lora_model.get_lora(name)
                    if weights is None:
                        layer.reset_lora(slot, writer)
                    else:
                        layer.set_lora(slot, weights, writer)
            finally:
                writer.flush()
        except Exception:
            self._clear(slot)
            raise
        self._slots.put(lora_model.lora_id, slot)
        self.counters.num_slot_loads += 1
        logger.info("LoRA adapter '%s' (id %d) now in slot %d", lora_model.name, lora_model.lora_id, slot)
        return slot

    def _clear(self, slot: int) -> None:
        """Zero what every layer holds in `slot`, in one batched write; the slot is free."""
        writer = BlockWriter()
        try:
            for layer in self.layers.values():
                layer.reset_lora(slot, writer)
        finally:
            writer.flush()
        self._free.add(slot)
