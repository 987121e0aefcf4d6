"""`HostCache`: validated adapters in host memory, at most `max_cpu_loras`, each read from disk once.

An LRU of loaded `LoRAModel`s by id, in the order requests asked for them (`hit` on each request's
arrival, not each step: the steps take adapters in the scheduler's turn order, which cycles through
them, the pattern that defeats LRU). To make room it evicts first the least recently requested adapter
no queued request needs (`set_needed`), and an adapter the queue needs only when every one is needed
(then the one needed last). A load reads and validates on the calling thread, outside the
manager's lock, so loads never stall a step; concurrent first requests for one adapter wait for a
single disk read (single flight). Everything is validated before the adapter is registered: a
failed load leaves no trace. The adapter's content digest is hashed on background threads during
the load (`LoRAModel.identity` waits for it).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass

from loraserve.errors import LoRAAdapterError
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.lru import CacheFullError, LRUCache
from loraserve.lora.request import LoRARequest

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
    """`read` turns a request into a validated adapter; `on_evict(lora_id)` runs when one is evicted.

    Every method but `load` expects the caller to hold `lock` (the manager's); `load` takes it itself
    around the bookkeeping only."""

    def __init__(
        self,
        capacity: int,
        read: Callable[[LoRARequest], LoRAModel],
        lock: threading.RLock,
        on_evict: Callable[[int], None],
    ) -> None:
        self.counters = HostCounters()
        self._read = read
        self._lock = lock
        self._on_evict = on_evict
        self._adapters: LRUCache[int, LoRAModel] = LRUCache(capacity, self._evicted)
        self._needed: tuple[int, ...] = ()  # adapters queued requests use, soonest needed first
        self._loading: dict[int, threading.Lock] = {}
        self._new_latencies: list[float] = []

    @property
    def capacity(self) -> int:
        return self._adapters.capacity

    @property
    def num_cached(self) -> int:
        return len(self._adapters)

    @property
    def num_loading(self) -> int:
        """Adapters being read from disk right now."""
        return len(self._loading)

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

    def set_needed(self, lora_ids: tuple[int, ...]) -> None:
        """The adapters that queued requests still use, soonest needed first: evicted only when
        every other adapter is needed or kept."""
        self._needed = lora_ids

    def drain_latencies(self) -> list[float]:
        """Disk load latencies (seconds) observed since the last call, for a histogram."""
        latencies, self._new_latencies = self._new_latencies, []
        return latencies

    def add(self, lora_model: LoRAModel, keep: Collection[int]) -> bool:
        """Register a loaded adapter; False if its id is already cached. A full cache first evicts
        one adapter not in `keep` (see the module docstring for which)."""
        if lora_model.lora_id in self._adapters:
            return False
        try:
            self._adapters.put(lora_model.lora_id, lora_model, keep, self._needed)
        except CacheFullError:
            raise LoRAAdapterError(
                f"LoRA adapter '{lora_model.name}': no room in host memory: the host cache (max_cpu_loras="
                f"{self.capacity}) holds only adapters it must keep (pinned, in the running step, or still "
                f"serving requests while being replaced or unloaded: {sorted(self.ids())}); retry later or "
                "raise --max-cpu-loras"
            ) from None
        return True

    def remove(self, lora_id: int) -> LoRAModel | None:
        """Drop an adapter (not an eviction: no hook); None if it is not cached."""
        return self._adapters.pop(lora_id)

    def load(
        self,
        lora_request: LoRARequest,
        keep: Callable[[], Collection[int]],
        admit: Callable[[LoRAModel], None],
    ) -> LoRAModel:
        """The cached adapter, or read, validate and add it. `keep()` (called under the lock) names
        the adapters the add may not evict; `admit` runs under the lock right after the add (the
        slot upload), and if it raises the adapter is dropped again and the load fails."""
        lora_id = lora_request.lora_id
        with self._lock:
            cached = self.hit(lora_id)
            if cached is not None:
                return cached
            load_lock = self._loading.setdefault(lora_id, threading.Lock())
        with load_lock:
            try:
                with self._lock:
                    cached = self.hit(lora_id)
                if cached is not None:
                    return cached
                return self._read_and_add(lora_request, keep, admit)
            finally:
                with self._lock:
                    if self._loading.get(lora_id) is load_lock:
                        del self._loading[lora_id]

    def read_fresh(self, lora_request: LoRARequest) -> LoRAModel:
        """Read and validate an adapter without looking at or filling the cache (an in-place reload
        of an id that is cached with other weights); counted as a load."""
        lora_model, elapsed = self._timed_read(lora_request)
        with self._lock:
            self._count_load(elapsed)
        return lora_model

    def _timed_read(self, lora_request: LoRARequest) -> tuple[LoRAModel, float]:
        """The adapter read and validated, and the seconds it took; a failure is counted."""
        start = time.perf_counter()
        try:
            lora_model = self._read(lora_request)
        except Exception:
            with self._lock:
                self.counters.num_load_failures += 1
            raise
        return lora_model, time.perf_counter() - start

    def _count_load(self, elapsed: float) -> None:  # under the lock
        self.counters.num_loads += 1
        self.counters.load_seconds_total += elapsed
        self._new_latencies.append(elapsed)

    def _read_and_add(
        self,
        lora_request: LoRARequest,
        keep: Callable[[], Collection[int]],
        admit: Callable[[LoRAModel], None],
    ) -> LoRAModel:
        lora_model, elapsed = self._timed_read(lora_request)
        with self._lock:
            try:
                if not self.add(lora_model, keep()):
                    return self._adapters.get(lora_model.lora_id) or lora_model  # added meanwhile
                try:
                    admit(lora_model)
                except Exception:
                    self._adapters.pop(lora_model.lora_id)
                    raise
            except Exception:
                self.counters.num_load_failures += 1
                raise
            self._count_load(elapsed)
        return lora_model

    def _evicted(self, lora_id: int, lora_model: LoRAModel) -> None:
        logger.info("Evicting LoRA adapter '%s' (id %d) from the host cache", lora_model.name, lora_id)
        self.counters.num_host_evictions += 1
        self._on_evict(lora_id)
