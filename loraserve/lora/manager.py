"""`LoRAManager`: the one owner of the adapter lifecycle, from registration to slot to removal.

Three parts, one lock: the registry (adapters the engine serves, digests, removals in progress), the
host cache (up to `max_cpu_loras` validated adapters in memory, each read once) and the slot table
(the `max_loras` compute slots of the wrapped layers). A load goes one way: the folder
(`AdapterLocations`), the memory of broken files (`FailedLoads`), `adapter_read.read_adapter` with the
model's `LoRATargets` (built once, here), then the host cache and a free slot (that path, the reload
of an evicted adapter and the prefetch thread's work are `adapter_loader.AdapterLoader`'s, under this
lock; the reports are `residency`'s); the parts never call back. Evicting an adapter from the host
also frees its slot. The adapters of the current step are never evicted from either tier, pinned adapters never leave their slot. The host cache's order is that of request arrivals (`register`), and it evicts an
adapter that queued requests still need only when all are needed: the engine names its queue's
adapters through `follow_demand` (read on the engine thread; other threads' loads see its latest
snapshot).

Threads: the engine thread registers, removes, pins and prepares steps; `prefetch` and `stats` may
run on any thread. Disk reads happen outside the lock. Slot buffers are only written for slots the
current step does not use, so loads and pins may run while a forward pass is in flight.
"""

from __future__ import annotations

import concurrent.futures
import threading
import types
import weakref
from collections.abc import Callable, Collection, Sequence

import torch
from torch import nn

from loraserve import envs
from loraserve.config import LoRAConfig
from loraserve.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from loraserve.lora.adapter_loader import AdapterLoader, AdapterSets, LoaderParts, changed_key
from loraserve.lora.adapter_path import AdapterLocations
from loraserve.lora.adapter_read import ReadLimits
from loraserve.lora.digest import PendingDigest
from loraserve.lora.eviction import ReloadCosts
from loraserve.lora.failed_loads import FailedLoads
from loraserve.lora.host_cache import HostCache
from loraserve.lora.layers import wrap_model_for_lora
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.prefetch import Prefetcher
from loraserve.lora.registry import AdapterRegistry
from loraserve.lora.request import LoRARequest
from loraserve.lora.residency import lora_stats, resident_adapters, resident_versions
from loraserve.lora.single_flight import SingleFlight
from loraserve.lora.slot_table import SlotTable
from loraserve.lora.targets import LoRATargets


class LoRAManager:
    def __init__(
        self, model: nn.Module, lora_config: LoRAConfig, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        self.lora_config = lora_config
        self._lora_dtype = lora_config.lora_dtype or dtype
        self._lock = threading.RLock()
        self._registry = AdapterRegistry()
        # The one look at the model's modules.
        targets = LoRATargets.from_model(model, lora_config.enable_tower_connector_lora)
        targets.check_target_modules(lora_config.target_modules)
        wrapped = wrap_model_for_lora(model, lora_config)
        self._slots = SlotTable(wrapped, lora_config.max_loras)
        self._targets = targets.restricted_to(wrapped)
        self._limits = ReadLimits.for_targets(
            targets, lora_config.max_lora_rank, lora_config.enable_lora_bias, self._lora_dtype
        )
        # No bound method of the manager goes into its parts: a cycle would keep every cached adapter
        # alive after the engine is dropped, until a garbage-collector pass (seconds of freeing GBs).
        self._locations = AdapterLocations()  # lora_path (maybe ~ or a Hub repo id) -> local folder
        # The same broken files fail fast, without another read; fingerprinted where they really are.
        self._failed = FailedLoads()
        costs = self._costs = ReloadCosts()  # expected reload seconds, for the "cost" policy
        self._host = HostCache(
            lora_config.cpu_capacity,
            lora_config.eviction_policy,
            lambda m: costs.expected_seconds(m.path, m.num_bytes),
        )
        self._flights = SingleFlight()  # one disk read per adapter however many threads ask
        # The step's adapters, the retained ones (being removed while requests run: the host cache
        # keeps them), the DoRA and vocab-replacing ones: shared with the loader, rebound under the lock.
        self._sets = AdapterSets()
        self._demand: Callable[[], Callable[[], Sequence[int]] | None] | None = None
        self._loader = AdapterLoader(
            LoaderParts(
                self._lock, self._registry, self._host, self._slots, self._sets, self._locations,
                self._failed, costs, self._flights, self._targets, self._limits, lora_config.max_lora_rank,
            )
        )  # fmt: skip
        # Evicted adapters the queue needs are read back beside the step (LORASERVE_LORA_PREFETCH=0: off).
        self._prefetcher = Prefetcher(self._loader.prefetch_one) if envs.lora_prefetch() else None
        if self._prefetcher is not None:
            weakref.finalize(self, self._prefetcher.close)

    def follow_demand(self, source: Callable[[], Sequence[int]]) -> None:
        """`source()` (called on the engine thread, at each step and before each first load) names
        the adapters that unfinished requests use, soonest needed first; the host cache evicts
        them last. A bound method is held weakly: the engine's scheduler holds this manager."""
        self._demand = weakref.WeakMethod(source) if isinstance(source, types.MethodType) else lambda: source

    def refresh_demand(self) -> None:
        """Hand the host cache the queue's adapters as they are now (engine thread: at each step, before
        each first load, and after requests end)."""
        source = self._demand() if self._demand is not None else None
        if source is not None:
            needed = tuple(source())
            with self._lock:
                self._host.set_needed(needed)

    def _note_queued(self, lora_id: int, explicit: bool) -> None:
        """Under the lock: the prefetch thread may evict before the next step reads the queue, so a
        registered request's adapter is needed from now on, not from then (only where a queue is read:
        without one, `needed` is never refreshed)."""
        if self._demand is not None and not explicit:  # an add_lora call queues no request
            self._host.note_needed(lora_id)

    # ---- registration (engine thread) -----------------------------------------------------------
    def register(
        self, lora_request: LoRARequest, explicit: bool = False, also_keep: Collection[int] = ()
    ) -> PendingDigest:
        """Load and validate an adapter (idempotent for the same id, name and path); return its
        identity digest, the prefix-cache salt, which may still be hashing on background threads: a
        cold adapter's first request does not wait for it. `explicit` (an add_lora call) lifts an unload."""
        with self._lock:
            lora_request = self._registry.successor(lora_request)
            digest = self._registry.check_can_register(lora_request, explicit)
            if digest is not None:
                self._host.hit(lora_request.lora_id)  # a request arrived: most recently used (if cached)
                self._note_queued(lora_request.lora_id, explicit)
        if digest is not None:
            return digest
        self.refresh_demand()
        digest = self.load(lora_request, also_keep=also_keep).pending_digest
        with self._lock:
            self._registry.add(lora_request, digest)
            self._note_queued(lora_request.lora_id, explicit)
        return digest

    def uses_dora(self, lora_id: int) -> bool:
        """Whether a loaded adapter is a DoRA one (its requests cannot set a scale: g depends on it)."""
        return lora_id in self._sets.dora

    def replaces_rows(self, lora_id: int) -> bool:
        """Whether a loaded adapter replaces vocab weights (trainable tokens, modules_to_save): a
        replaced row has no strength to scale, so its requests cannot set a scale."""
        return lora_id in self._sets.replacing

    def is_registered(self, lora_id: int) -> bool:
        with self._lock:
            return lora_id in self._registry.requests

    def list_requests(self) -> list[LoRARequest]:
        """Registered adapters, less those being removed."""
        with self._lock:
            return self._registry.listed()

    def digest(self, lora_id: int) -> str:
        """The content digest of a registered adapter (the prefix-cache salt; waits while it is still
        hashing); LoRAAdapterNotFoundError when it is not registered. Any thread."""
        with self._lock:
            pending = self._registry.digests.get(lora_id)
        if pending is None:
            raise LoRAAdapterNotFoundError(f"LoRA id {lora_id} is not registered.")
        return pending.result()

    def successor(self, lora_request: LoRARequest) -> LoRARequest:
        """The adapter serving `lora_request` now: itself, or what replaced it in place (any thread)."""
        with self._lock:
            return self._registry.successor(lora_request)

    def prefetch(self, lora_request: LoRARequest, also_keep: Collection[int] = ()) -> None:
        """Read and validate an adapter the engine does not serve yet, so that registering it later
        finds it cached (evicting none of `also_keep`). Any thread; one read per adapter."""
        lora_request = self.successor(lora_request)
        if not self.is_registered(lora_request.lora_id):
            self.load(lora_request, also_keep=also_keep)

    def replace(self, old_id: int, lora_request: LoRARequest, in_use: bool) -> PendingDigest:
        """Serve `lora_request` in place of registered adapter `old_id` (vLLM's load_inplace); its digest.

        The new weights are read and validated first: if that fails nothing changes. Under a new id
        (the server's way) the old adapter's running requests finish on its weights and it is removed
        once they are done (`removal(old_id)`); its pin moves over, and requests that still carry the
        old id start on the new weights. Under the same id (`LLM`'s way) no request may be using it.
        Either way the digest, hence the prefix-cache salt, is the new content's."""
        with self._lock:
            if old_id not in self._registry.requests or old_id in self._registry.pending_removals:
                raise LoRAAdapterNotFoundError(f"LoRA id {old_id} is not registered; load it first.")
        if lora_request.lora_id != old_id:
            digest = self.register(lora_request, explicit=True, also_keep=(old_id,) if in_use else ())
            with self._lock:
                new_model = self._host.peek(lora_request.lora_id)
                if self._slots.unpin(old_id) and new_model is not None:
                    self._slots.pin(new_model, self._sets.in_use)
                self._registry.redirect(old_id, lora_request.lora_id)
                self.remove(old_id, in_use)
            return digest
        if in_use:
            raise LoRAAdapterError(
                f"LoRA adapter {lora_request.lora_name!r} (id {old_id}) is used by running requests; reload "
                "it in place once they finish, or under a new id."
            )
        self._locations.forget(old_id)  # a Hub repo id is looked up again: the point is new weights
        fresh, elapsed = self._loader.read(lora_request)
        digest = fresh.pending_digest
        with self._lock:
            pinned = old_id in self._slots.pinned_ids
            self._loader.drop(old_id)
            self._loader.put(fresh, self._slots.pinned_ids | self._sets.in_use, elapsed)
            if pinned:
                self._slots.pin(fresh, self._sets.in_use)
            self._registry.add(lora_request, digest)
        return digest

    def pin(self, lora_id: int) -> bool:
        """Keep a registered adapter in a slot (and the host cache) until removed; False if it is
        pinned already."""
        with self._lock:
            lora_request = self._registry.requests.get(lora_id)
            if lora_request is None:
                raise LoRAAdapterError(f"LoRA id {lora_id} is not registered.")
            lora_model = self._host.peek(lora_id)
            if lora_model is None:
                raise ValueError(f"cannot pin LoRA adapter {lora_request.lora_name!r}: it is not loaded")
            return self._slots.pin(lora_model, self._sets.in_use)

    def remove(self, lora_id: int, in_use: bool) -> bool:
        """Unregister an adapter: now if no request uses it, else once `finish_removals` finds them
        done (`removal` tells when). False if it is not registered or already being removed."""
        with self._lock:
            if lora_id not in self._registry.requests or lora_id in self._registry.pending_removals:
                return False
            if in_use:
                self._registry.defer_removal(lora_id)
                self._sets.retained = self._sets.retained | {lora_id}
            else:
                self._forget(lora_id)
            return True

    def removal(self, lora_id: int) -> concurrent.futures.Future[None]:
        """Completes once `lora_id` is gone; already complete unless its removal is deferred."""
        with self._lock:
            pending = self._registry.pending_removals.get(lora_id)
        if pending is not None:
            return pending
        done: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.set_result(None)
        return done

    @property
    def has_pending_removals(self) -> bool:
        return bool(self._registry.pending_removals)

    def finish_removals(self, in_use: Collection[int]) -> None:
        """Complete the deferred removals of adapters that no request in `in_use` uses any more."""
        with self._lock:
            for lora_id in [i for i in self._registry.pending_removals if i not in in_use]:
                self._forget(lora_id)

    def _forget(self, lora_id: int) -> None:
        self._sets.retained = self._sets.retained - {lora_id}
        self._loader.drop(lora_id)
        self._registry.forget(lora_id)
        self._failed.forget(changed_key(lora_id))
        self._locations.forget(lora_id)

    # ---- steps (engine thread) ------------------------------------------------------------------
    def can_activate(self, lora_ids: Collection[int]) -> bool:
        """Whether a step of `lora_ids` finds a slot for each (pinned slots stay taken)."""
        with self._lock:
            return self._slots.can_fit(lora_ids)

    def prepare_step(self, lora_ids: set[int]) -> tuple[dict[int, int], dict[int, Exception]]:
        """Put a step's adapters in host memory and compute slots.

        An adapter the host cache evicted is read again; one whose reload fails or finds other
        weights fails that adapter's requests only. Returns (id -> slot for the adapters ready,
        id -> error for the others). The adapters stay protected from eviction until `end_step`.
        """
        self.refresh_demand()
        with self._lock:
            self._sets.in_use = frozenset(lora_ids)
        self._prefetch_waiting(lora_ids)
        failed: dict[int, Exception] = {}
        for lora_id in lora_ids:
            try:
                self._loader.reload(lora_id, lora_ids)
            except Exception as exc:  # noqa: BLE001 - any failure fails this adapter's requests only
                failed[lora_id] = exc
        return self.activate(lora_ids - failed.keys()), failed

    # ---- prefetch (engine thread asks, the prefetch thread reads) ---------------------------------
    def _prefetch_waiting(self, step_ids: Collection[int]) -> None:
        """Name to the prefetch thread the queued adapters, soonest needed first, that are out of host
        memory or out of a slot: as many as the host cache holds beside the pinned ones."""
        if self._prefetcher is None:
            return
        with self._lock:
            room = self._host.capacity - len(self._slots.pinned_ids)
            wanted = [
                i for i in self._host.needed[:room]
                if i not in step_ids and i in self._registry.requests
                and (i not in self._host or (self._slots.slot_of(i) is None and self._slots.has_free))
            ]  # fmt: skip
        self._prefetcher.want(wanted)

    def wait_prefetch_idle(self, timeout: float | None = None) -> bool:
        """Wait until the prefetch thread has nothing left to read (True; False after `timeout`)."""
        return self._prefetcher is None or self._prefetcher.wait_idle(timeout)

    def end_step(self) -> None:
        """The step is over: its adapters may be evicted again (their requests reload them if needed)."""
        with self._lock:
            self._sets.in_use = frozenset()

    def check_consistency(self) -> str | None:
        """What is wrong with the slot bookkeeping between steps; None if it is consistent."""
        with self._lock:
            if self._sets.in_use:
                return f"LoRA adapters {sorted(self._sets.in_use)} are still marked in use after the step"
            return self._slots.check_consistency()

    def activate(self, lora_ids: set[int]) -> dict[int, int]:
        """Put every adapter of a step in a slot; id -> slot. Never evicts an adapter of the step or
        a pinned one; refreshes the slots' LRU order (the host's follows request arrivals)."""
        with self._lock:
            unknown = sorted(i for i in lora_ids if i not in self._host)
            if unknown:
                raise ValueError(f"LoRA adapters {unknown} are not loaded (load them first)")
            if not self._slots.can_fit(lora_ids):
                free = self.lora_config.max_loras - len(self._slots.pinned_ids - lora_ids)
                raise ValueError(
                    f"a step needs {len(lora_ids)} LoRA slots but only {free} of max_loras="
                    f"{self.lora_config.max_loras} are not held by pinned adapters"
                )
            self._sets.in_use = frozenset(lora_ids)
            slots: dict[int, int] = {}
            # Adapters already in a slot first, so that a miss never evicts one the step needs.
            for lora_id in sorted(lora_ids, key=lambda i: self._slots.slot_of(i) is None):
                lora_model = self._host.peek(lora_id)
                assert lora_model is not None
                slots[lora_id] = self._slots.acquire(lora_model, lora_ids)
            return slots

    # ---- loading (any thread) -------------------------------------------------------------------
    def load(
        self,
        lora_request: LoRARequest,
        protected: Collection[int] | None = None,
        also_keep: Collection[int] = (),
    ) -> LoRAModel:
        """The adapter from the host cache, else read, validated and cached (and written into a free
        slot, if any). To make room the cache evicts no pinned adapter, no `protected` one (default:
        the adapters of the current step, as it is once the read is done), no retained one (being removed while requests run) and
        none of `also_keep`. The read runs outside the lock; concurrent loads of one id read once."""
        return self._loader.load(lora_request, protected, also_keep)

    def get_adapter(self, lora_id: int) -> LoRAModel | None:
        with self._lock:
            return self._host.peek(lora_id)

    def has_modules_under(self, lora_id: int, prefixes: tuple[str, ...]) -> bool:
        """Whether a loaded adapter carries weights for a module under one of `prefixes` (a
        vision-language model's tower and connector: its images are encoded with its terms)."""
        adapter = self.get_adapter(lora_id)
        return adapter is not None and any(name.startswith(prefixes) for name in adapter.loras)

    def slot_of(self, lora_id: int) -> int | None:
        with self._lock:
            return self._slots.slot_of(lora_id)

    # ---- metrics (any thread) -------------------------------------------------------------------
    def resident_adapters(self) -> dict[str, list[str]]:
        """Adapter names by residency level, each list sorted and without repeats: "host" = in host
        memory, "slot" = in a compute slot. A slot holds only adapters that are in host memory, so
        every "slot" name is also a "host" name (an adapter replaced in place may appear twice
        under one name while its old requests finish: it is listed once). Mixes are listed as
        MIX_LABEL: their names hold clients' weights."""
        with self._lock:
            return resident_adapters(self._host, self._slots)

    def resident_versions(self) -> dict[str, str]:
        """Registered adapters held in memory, by `LoRARequest.version_key` of their digest ("name@<12
        digits>") -> "slot" or "host": what a replica tells the router, so that two versions of one
        name are never taken for each other. Digests still hashing are left out. Any thread."""
        with self._lock:
            return resident_versions(self._host, self._registry, self._slots)

    def stats(self) -> dict[str, int | float | str | list[float]]:
        """Counters and occupancy, keys prefixed `lora_`; `lora_load_seconds` lists the disk load
        latencies observed since the previous call (a histogram's new observations)."""
        with self._lock:
            return lora_stats(self._host, self._slots, self._flights, self._prefetcher)
