"""`HostCache`: validated adapters in host memory, at most `max_cpu_loras`, and their counters.

An `lru.LRUCache` of what `adapter_read.read_adapter` returns, by id, under policy "lru" (recency) or
"cost" (GreedyDual: recency and frequency weighed by each adapter's expected reload seconds, which
the `cost_of` callback gives when a victim is chosen), touched in the order requests asked for them
(`hit` on each request's arrival, not each step: the steps take adapters in the scheduler's turn
order, which cycles through them, the pattern that defeats LRU). To make room it evicts first, in
policy order, the adapters no queued request needs (`set_needed`), and an adapter the queue needs
only when every one is needed (then the one needed last). It reads nothing and calls nobody: the
manager reads, puts the result here, and frees the slots of the adapters `add` reports evicted.
Not thread-safe: the manager holds its lock around every call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass

from loraserve.errors import LoRAAdapterError
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.lru import CacheFullError, LRUCache

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class HostCounters:
    """Monotonic counters for metrics."""

    num_loads: int = 0  # adapters read from disk and registered
    num_load_failures: int = 0
    num_host_hits: int = 0  # a request (or a load) found its adapter already cached
    num_host_evictions: int = 0
    load_seconds_total: float = 0.0


class HostCache:
    """Loaded adapters by id, at most `capacity`; see the module docstring for the eviction order."""

    def __init__(
        self, capacity: int, policy: str = "lru", cost_of: Callable[[LoRAModel], float] | None = None
    ) -> None:
        self.counters = HostCounters()
        cost = None if cost_of is None else (lambda _id, lora_model: cost_of(lora_model))
        self._adapters: LRUCache[int, LoRAModel] = LRUCache(capacity, self._evicted, policy, cost)
        self._needed: tuple[int, ...] = ()  # adapters queued requests use, soonest needed first
        self._just_evicted: list[int] = []  # the evictions of the `add` in progress
        self._new_latencies: list[float] = []

    @property
    def capacity(self) -> int:
        return self._adapters.capacity

    @property
    def policy(self) -> str:
        return self._adapters.policy

    @property
    def num_cached(self) -> int:
        return len(self._adapters)

    def __contains__(self, lora_id: int) -> bool:
        return lora_id in self._adapters

    def ids(self) -> list[int]:
        """Cached adapter ids, least recently used first."""
        return self._adapters.keys()

    def peek(self, lora_id: int) -> LoRAModel | None:
        return self._adapters.peek(lora_id)

    def hit(self, lora_id: int) -> LoRAModel | None:
        """The adapter, now the most recently used, counted as a host hit; None if not cached."""
        cached = self._adapters.get(lora_id)
        if cached is not None:
            self.counters.num_host_hits += 1
        return cached

    @property
    def needed(self) -> tuple[int, ...]:
        """The adapters queued requests use, soonest needed first (as `set_needed` last said)."""
        return self._needed

    def set_needed(self, lora_ids: tuple[int, ...]) -> None:
        """The adapters that queued requests still use, soonest needed first: evicted only when
        every other adapter is needed or kept."""
        self._needed = lora_ids

    def needed_before(self, lora_id: int) -> NeededBefore:
        """The adapters the queue needs sooner than `lora_id` (all it needs if it needs not that one),
        read each time the view is iterated (see `NeededBefore`)."""
        return NeededBefore(self, lora_id)

    def note_needed(self, lora_id: int) -> None:
        """A request for `lora_id` was queued since the last `set_needed`: it is needed, after those
        already named (the next `set_needed`, read from the queue, replaces the order)."""
        if lora_id not in self._needed:
            self._needed = (*self._needed, lora_id)

    def add(self, lora_model: LoRAModel, keep: Collection[int]) -> list[int] | None:
        """Cache a loaded adapter as the most recently used; the ids evicted to make room (their
        slots are the caller's to free), or None if its id is already cached (nothing changes).
        A full cache evicts none of `keep`; LoRAAdapterError when only kept adapters are left."""
        if lora_model.lora_id in self._adapters:
            return None
        self._just_evicted = []
        try:
            self._adapters.put(lora_model.lora_id, lora_model, keep, self._needed)
        except CacheFullError:
            raise LoRAAdapterError(
                f"LoRA adapter '{lora_model.name}': no room in host memory: the host cache (max_cpu_loras="
                f"{self.capacity}) holds only adapters it must keep (pinned, in the running step, or still "
                f"serving requests while being replaced or unloaded: {sorted(self.ids())}); retry later or "
                "raise --max-cpu-loras"
            ) from None
        evicted, self._just_evicted = self._just_evicted, []
        return evicted

    def remove(self, lora_id: int) -> LoRAModel | None:
        """Drop an adapter (not an eviction: not counted); None if it is not cached."""
        return self._adapters.pop(lora_id)

    def count_load(self, seconds: float) -> None:
        """An adapter was read from disk in `seconds` and put to use."""
        self.counters.num_loads += 1
        self.counters.load_seconds_total += seconds
        self._new_latencies.append(seconds)

    def count_failure(self) -> None:
        self.counters.num_load_failures += 1

    def drain_latencies(self) -> list[float]:
        """Disk load latencies (seconds) observed since the last call, for a histogram."""
        latencies, self._new_latencies = self._new_latencies, []
        return latencies

    def _evicted(self, lora_id: int, lora_model: LoRAModel) -> None:
        logger.info("Evicting LoRA adapter '%s' (id %d) from the host cache", lora_model.name, lora_id)
        self.counters.num_host_evictions += 1
        self._just_evicted.append(lora_id)


class NeededBefore(Collection[int]):
    """A live view of `HostCache.needed_before`: what a background read keeps when it caches its
    result. Computed when the result is put (under the manager's lock), not when the read began: an
    adapter whose requests finished during a long read is no longer kept, so the read does not evict
    an adapter the queue still needs to keep one it no longer does."""

    __slots__ = ("_host", "_lora_id")

    def __init__(self, host: HostCache, lora_id: int) -> None:
        self._host, self._lora_id = host, lora_id

    def _ids(self) -> tuple[int, ...]:
        needed = self._host.needed
        return needed[: needed.index(self._lora_id)] if self._lora_id in needed else needed

    def __iter__(self) -> Iterator[int]:
        return iter(self._ids())

    def __len__(self) -> int:
        return len(self._ids())

    def __contains__(self, lora_id: object) -> bool:
        return lora_id in self._ids()
