"""`LoRAModelManager`: the host cache of loaded adapters and the compute slots they run in.

Two LRU tiers: up to `cpu_capacity` validated adapters on the host, and `max_loras` slots in the
wrapped layers' stacked buffers. Evicting an adapter from the host also frees its slot. An adapter
of the current step (`activate`) is never evicted, pinned adapters never leave their slot, and at most
max_loras - 1 adapters can be pinned so that other adapters can still run.

Thread safety: every method takes one lock, and disk reads happen outside it. Slot buffers are only
written for slots that the current step does not use, so loading and pinning may run while a forward
pass is in flight; removing an adapter that running requests still use is the engine's to prevent.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Collection
from dataclasses import asdict, dataclass

import torch
from torch import nn

from loraserve.config import LoRAConfig
from loraserve.errors import LoRAAdapterError
from loraserve.lora.layers import LinearWithLoRA, wrap_model_for_lora
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.ops import cpu_ops
from loraserve.lora.peft_helper import PEFTHelper
from loraserve.lora.request import LoRARequest
from loraserve.lora.slot_writer import clear_slot, write_adapter

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class LoRAManagerStats:
    """Counters for metrics (monotonic)."""

    num_loads: int = 0  # adapters read from disk and registered
    num_load_failures: int = 0
    num_host_hits: int = 0  # load_and_add found the adapter already cached
    num_slot_hits: int = 0  # activate found the adapter already in a slot
    num_slot_loads: int = 0  # adapter copied into a slot
    num_slot_evictions: int = 0
    num_host_evictions: int = 0
    load_seconds_total: float = 0.0


class LoRAModelManager:
    """Owns the wrapped LoRA layers of `model` and which adapter sits in which slot."""

    def __init__(
        self, model: nn.Module, lora_config: LoRAConfig, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.model = model
        self.lora_config = lora_config
        self.device = torch.device(device)
        self.lora_dtype = lora_config.lora_dtype or dtype
        self.modules: dict[str, LinearWithLoRA] = wrap_model_for_lora(model, lora_config)
        self.counters = LoRAManagerStats()
        self._host: OrderedDict[int, LoRAModel] = OrderedDict()  # least recently used first
        self._slot_ids: list[int | None] = [None] * lora_config.max_loras
        self._slot_lru: OrderedDict[int, int] = OrderedDict()  # adapter id -> slot, LRU first
        self._pinned: set[int] = set()
        self._in_use: frozenset[int] = frozenset()
        self._load_latencies: list[float] = []
        self._load_locks: dict[int, threading.Lock] = {}
        self._lock = threading.RLock()
        if self.device.type == "cpu" and self.lora_dtype == torch.float32:
            cpu_ops.kernel_available()  # build the CPU kernel (~1 s) now, not on a first request

    @property
    def max_loras(self) -> int:
        return self.lora_config.max_loras

    @property
    def capacity(self) -> int:
        return self.lora_config.cpu_capacity

    def list_adapters(self) -> dict[int, LoRAModel]:
        """Cached adapters by id, least recently used first."""
        with self._lock:
            return dict(self._host)

    def has_adapter(self, adapter_id: int) -> bool:
        with self._lock:
            return adapter_id in self._host

    def stats(self) -> dict[str, int | float]:
        """Counters and occupancy for metrics, keys prefixed `lora_`."""
        with self._lock:
            out: dict[str, int | float] = {f"lora_{k}": v for k, v in asdict(self.counters).items()}
            out["lora_num_cached"] = len(self._host)
            out["lora_num_active_slots"] = len(self._slot_lru)
            out["lora_num_pinned"] = len(self._pinned)
            return out

    def get_adapter(self, adapter_id: int) -> LoRAModel | None:
        with self._lock:
            return self._host.get(adapter_id)

    def slot_of(self, adapter_id: int) -> int | None:
        with self._lock:
            return self._slot_lru.get(adapter_id)

    def is_pinned(self, adapter_id: int) -> bool:
        with self._lock:
            return adapter_id in self._pinned

    def drain_load_latencies(self) -> list[float]:
        """Disk load latencies (seconds) observed since the last call, for a histogram."""
        with self._lock:
            latencies, self._load_latencies = self._load_latencies, []
            return latencies

    def add_adapter(self, lora_model: LoRAModel, protected: Collection[int] | None = None) -> bool:
        """Register a loaded adapter in the host cache; False if its id is already there.

        A full cache evicts its least recently used adapter that is neither pinned nor protected.
        Protected are the adapters of the last `activate` (a step that may be running), unless the
        caller prepares the next step and passes its adapters as `protected` instead.
        """
        with self._lock:
            if lora_model.id in self._host:
                return False
            keep = self._pinned | (self._in_use if protected is None else set(protected))
            while len(self._host) >= self.capacity:
                victim = next((i for i in self._host if i not in keep), None)
                if victim is None:
                    raise ValueError(
                        f"cannot add LoRA adapter '{lora_model.name}': the host cache (max_cpu_loras="
                        f"{self.capacity}) holds only pinned adapters or adapters of the step "
                        f"({sorted(keep)})"
                    )
                logger.info("Evicting LoRA adapter %d from the host cache", victim)
                self._remove(victim)
                self.counters.num_host_evictions += 1
            self._host[lora_model.id] = lora_model
            logger.debug("Added LoRA adapter '%s' (id %d)", lora_model.name, lora_model.id)
            return True

    def remove_adapter(self, adapter_id: int) -> bool:
        """Drop an adapter from the host cache and its slot; False if it is not loaded."""
        with self._lock:
            if adapter_id not in self._host:
                return False
            self._remove(adapter_id)
            return True

    def _remove(self, adapter_id: int) -> None:
        slot = self._slot_lru.pop(adapter_id, None)
        if slot is not None:
            self._slot_ids[slot] = None
            clear_slot(self.modules, slot)
        self._pinned.discard(adapter_id)
        self._in_use = self._in_use - {adapter_id}
        del self._host[adapter_id]

    def reserve(self, adapter_ids: Collection[int]) -> None:
        """Protect a step's adapters from host eviction (by loads on other threads) until `release`."""
        with self._lock:
            self._in_use = frozenset(adapter_ids)

    def release(self) -> None:
        """The step is over: its adapters may be evicted again (their requests reload them if needed)."""
        with self._lock:
            self._in_use = frozenset()

    def can_activate(self, adapter_ids: set[int]) -> bool:
        """Whether `activate(adapter_ids)` would find a slot for each (pinned slots stay taken)."""
        with self._lock:
            pinned_elsewhere = len(self._pinned - adapter_ids)
            return len(adapter_ids) <= self.max_loras - pinned_elsewhere

    def activate(self, adapter_ids: set[int]) -> dict[int, int]:
        """Put every adapter of a step in a slot and return id -> slot.

        Never evicts an adapter of `adapter_ids` or a pinned one; refreshes both LRU orders.
        """
        with self._lock:
            unknown = sorted(i for i in adapter_ids if i not in self._host)
            if unknown:
                raise ValueError(f"LoRA adapters {unknown} are not loaded (call load_and_add first)")
            if not self.can_activate(adapter_ids):
                raise ValueError(
                    f"a step needs {len(adapter_ids)} LoRA slots but only "
                    f"{self.max_loras - len(self._pinned - adapter_ids)} of max_loras={self.max_loras} "
                    "are not held by pinned adapters"
                )
            self._in_use = frozenset(adapter_ids)
            result: dict[int, int] = {}
            for adapter_id in sorted(adapter_ids, key=lambda i: i not in self._slot_lru):
                result[adapter_id] = self._ensure_slot(adapter_id)
                self._host.move_to_end(adapter_id)
            return result

    def _ensure_slot(self, adapter_id: int) -> int:
        """The adapter's slot, loading it into a free or least recently used slot if needed."""
        if adapter_id in self._slot_lru:
            self._slot_lru.move_to_end(adapter_id)
            self.counters.num_slot_hits += 1
            return self._slot_lru[adapter_id]
        slot = next((s for s, i in enumerate(self._slot_ids) if i is None), None)
        if slot is None:
            victim = next(
                (i for i in self._slot_lru if i not in self._pinned and i not in self._in_use), None
            )
            if victim is None:
                raise ValueError(
                    f"no free LoRA slot for adapter {adapter_id}: all max_loras={self.max_loras} slots "
                    "hold pinned adapters or adapters of the running step"
                )
            slot = self._slot_lru.pop(victim)
            self.counters.num_slot_evictions += 1
        try:
            write_adapter(self.modules, slot, self._host[adapter_id])
        except Exception:
            self._slot_ids[slot] = None
            raise
        self._slot_ids[slot] = adapter_id
        self._slot_lru[adapter_id] = slot
        self.counters.num_slot_loads += 1
        logger.info("Activating LoRA. int id: %d, slot index: %d", adapter_id, slot)
        return slot

    def _preactivate(self, adapter_id: int) -> None:
        """Upload a freshly loaded adapter to a free slot now, on the loading thread (while its digest
        is still being hashed on others), so its first step finds it in place. Never evicts: a step
        that is running uses other slots. A refusal unregisters the adapter (its load fails)."""
        if adapter_id in self._slot_lru or None not in self._slot_ids:
            return
        try:
            self._ensure_slot(adapter_id)
        except Exception:
            self._remove(adapter_id)
            raise

    def pin_adapter(self, adapter_id: int) -> bool:
        """Keep an adapter in a slot (and the host cache) until removed; False if already pinned."""
        with self._lock:
            if adapter_id not in self._host:
                raise ValueError(f"cannot pin LoRA adapter {adapter_id}: it is not loaded")
            if adapter_id in self._pinned:
                return False
            if len(self._pinned) + 1 >= self.max_loras:
                raise ValueError(
                    f"cannot pin LoRA adapter {adapter_id}: {len(self._pinned)} adapters are pinned and "
                    f"max_loras={self.max_loras}; pinning every slot would leave none for other adapters "
                    "(at most max_loras - 1 can be pinned)"
                )
            self._ensure_slot(adapter_id)
            self._pinned.add(adapter_id)
            return True

    def load_and_add(self, lora_request: LoRARequest, protected: Collection[int] | None = None) -> LoRAModel:
        """Read, validate and register an adapter (a cached one is returned as is).

        Validation is complete before anything is registered: a failed load leaves no trace.
        `protected` ids are not evicted from the host cache to make room (see `add_adapter`).
        """
        adapter_id = lora_request.lora_int_id
        with self._lock:
            cached = self._cached(adapter_id)
            if cached is not None:
                return cached
            # Single flight: concurrent first requests for one adapter wait for one disk load.
            load_lock = self._load_locks.setdefault(adapter_id, threading.Lock())
        with load_lock:
            with self._lock:
                cached = self._cached(adapter_id)
                if cached is not None:
                    return cached
            try:
                return self._load(lora_request, protected)
            finally:
                with self._lock:
                    if self._load_locks.get(adapter_id) is load_lock:
                        del self._load_locks[adapter_id]

    def _cached(self, adapter_id: int) -> LoRAModel | None:
        cached = self._host.get(adapter_id)
        if cached is not None:
            self._host.move_to_end(adapter_id)
            self.counters.num_host_hits += 1
        return cached

    def _load(self, lora_request: LoRARequest, protected: Collection[int] | None) -> LoRAModel:
        start = time.perf_counter()
        try:
            helper = PEFTHelper.from_local_dir(
                lora_request.lora_path,
                lora_request.lora_name,
                self.lora_config.max_lora_rank,
                self.lora_config.enable_lora_bias,
            )
            lora_model = LoRAModel.from_local_checkpoint(
                lora_request.lora_path, lora_request, helper, self.model, self.lora_dtype, "cpu"
            )
        except Exception:
            with self._lock:
                self.counters.num_load_failures += 1
            raise
        elapsed = time.perf_counter() - start
        with self._lock:
            try:
                added = self.add_adapter(lora_model, protected)
            except ValueError:
                self.counters.num_load_failures += 1
                raise
            if not added:
                return self._host[lora_model.id]  # another thread registered it meanwhile
            try:
                self._preactivate(lora_model.id)
            except Exception as e:
                self.counters.num_load_failures += 1
                raise LoRAAdapterError(f"LoRA adapter '{lora_model.name}' does not fit a slot: {e}") from None
            self.counters.num_loads += 1
            self.counters.load_seconds_total += elapsed
            self._load_latencies.append(elapsed)
        return lora_model
