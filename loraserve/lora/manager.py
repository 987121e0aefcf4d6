"""`LoRAManager`: the one owner of the adapter lifecycle, from registration to slot to removal.

Three parts, one lock: the registry (adapters the engine serves, digests, removals in progress), the
host cache (up to `max_cpu_loras` validated adapters in memory, each read once) and the slot table
(the `max_loras` compute slots of the wrapped layers). A load goes one way: the folder
(`AdapterLocations`), the memory of broken files (`FailedLoads`), `adapter_read.read_adapter` with the
model's `LoRATargets` (built once, here), then the host cache and a free slot; the parts never call
back. Evicting an adapter from the host also frees its slot. The adapters of the current step are
never evicted from either tier, pinned adapters never leave their slot. The host cache's order is that of request arrivals (`register`), and it evicts an
adapter that queued requests still need only when all are needed: the engine names its queue's
adapters through `follow_demand` (read on the engine thread; other threads' loads see its latest
snapshot).

Threads: the engine thread registers, removes, pins and prepares steps; `prefetch` and `stats` may
run on any thread. Disk reads happen outside the lock. Slot buffers are only written for slots the
current step does not use, so loads and pins may run while a forward pass is in flight.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
import time
import types
import weakref
from collections.abc import Callable, Collection, Sequence
from dataclasses import asdict

import torch
from torch import nn

from loraserve import envs
from loraserve.config import LoRAConfig
from loraserve.errors import (
    LoRAAdapterChangedError,
    LoRAAdapterError,
    LoRAAdapterGoneError,
    LoRAAdapterNotFoundError,
)
from loraserve.lora.adapter_path import AdapterLocations
from loraserve.lora.adapter_read import ReadLimits, read_adapter
from loraserve.lora.digest import PendingDigest
from loraserve.lora.eviction import ReloadCosts, source_of
from loraserve.lora.failed_loads import FailedLoads
from loraserve.lora.host_cache import HostCache
from loraserve.lora.layers import wrap_model_for_lora
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.mix import MIX_LABEL, mix_adapters
from loraserve.lora.prefetch import Prefetcher
from loraserve.lora.registry import AdapterRegistry
from loraserve.lora.request import MIX_PATH_PREFIX, LoRARequest, version_key
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
        targets = LoRATargets.from_model(model)  # the one look at the model's modules
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
        # Evicted adapters the queue needs are read back beside the step (LORASERVE_LORA_PREFETCH=0: off).
        self._prefetcher = Prefetcher(self._prefetch_one) if envs.lora_prefetch() else None
        if self._prefetcher is not None:
            weakref.finalize(self, self._prefetcher.close)
        self._flights = SingleFlight()  # one disk read per adapter however many threads ask
        self._in_use: frozenset[int] = frozenset()  # the adapters of the step being prepared or run
        # Adapters being removed (unloaded or replaced in place) whose requests still run: their cached
        # copy may be the only one left (files deleted or overwritten), so the host cache keeps them.
        # Rebound, never mutated, so that other threads' keep() reads it without the lock.
        self._retained: frozenset[int] = frozenset()
        self._demand: Callable[[], Callable[[], Sequence[int]] | None] | None = None
        self._dora_ids: frozenset[int] = frozenset()  # loaded adapters with DoRA scales (any thread reads)
        self._replacing_ids: frozenset[int] = frozenset()  # loaded adapters replacing vocab rows (likewise)

    def follow_demand(self, source: Callable[[], Sequence[int]]) -> None:
        """`source()` (called on the engine thread, at each step and before each first load) names
        the adapters that unfinished requests use, soonest needed first; the host cache evicts
        them last. A bound method is held weakly: the engine's scheduler holds this manager."""
        self._demand = weakref.WeakMethod(source) if isinstance(source, types.MethodType) else lambda: source

    def _refresh_needed(self) -> None:
        """Hand the host cache the queue's adapters as they are now (engine thread)."""
        source = self._demand() if self._demand is not None else None
        if source is not None:
            needed = tuple(source())
            with self._lock:
                self._host.set_needed(needed)

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
        if digest is not None:
            return digest
        self._refresh_needed()
        digest = self.load(lora_request, also_keep=also_keep).pending_digest
        with self._lock:
            self._registry.add(lora_request, digest)
        return digest

    def uses_dora(self, lora_id: int) -> bool:
        """Whether a loaded adapter is a DoRA one (its requests cannot set a scale: g depends on it)."""
        return lora_id in self._dora_ids

    def replaces_rows(self, lora_id: int) -> bool:
        """Whether a loaded adapter replaces vocab weights (trainable tokens, modules_to_save): a
        replaced row has no strength to scale, so its requests cannot set a scale."""
        return lora_id in self._replacing_ids

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
                    self._slots.pin(new_model, self._in_use)
                self._registry.redirect(old_id, lora_request.lora_id)
                self.remove(old_id, in_use)
            return digest
        if in_use:
            raise LoRAAdapterError(
                f"LoRA adapter {lora_request.lora_name!r} (id {old_id}) is used by running requests; reload "
                "it in place once they finish, or under a new id."
            )
        self._locations.forget(old_id)  # a Hub repo id is looked up again: the point is new weights
        fresh, elapsed = self._read(lora_request)
        digest = fresh.pending_digest
        with self._lock:
            pinned = old_id in self._slots.pinned_ids
            self._drop(old_id)
            self._put(fresh, self._slots.pinned_ids | self._in_use, elapsed)
            if pinned:
                self._slots.pin(fresh, self._in_use)
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
            return self._slots.pin(lora_model, self._in_use)

    def remove(self, lora_id: int, in_use: bool) -> bool:
        """Unregister an adapter: now if no request uses it, else once `finish_removals` finds them
        done (`removal` tells when). False if it is not registered or already being removed."""
        with self._lock:
            if lora_id not in self._registry.requests or lora_id in self._registry.pending_removals:
                return False
            if in_use:
                self._registry.defer_removal(lora_id)
                self._retained = self._retained | {lora_id}
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
        self._retained = self._retained - {lora_id}
        self._drop(lora_id)
        self._registry.forget(lora_id)
        self._failed.forget(_changed_key(lora_id))
        self._locations.forget(lora_id)

    def _drop(self, lora_id: int) -> None:
        """The adapter leaves the host cache and its slot (it stays registered)."""
        self._host.remove(lora_id)
        self._slots.release(lora_id)
        self._in_use = self._in_use - {lora_id}

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
        self._refresh_needed()
        with self._lock:
            self._in_use = frozenset(lora_ids)
        self._prefetch_waiting(lora_ids)
        failed: dict[int, Exception] = {}
        for lora_id in lora_ids:
            try:
                self._reload(lora_id, lora_ids)
            except Exception as exc:  # noqa: BLE001 - any failure fails this adapter's requests only
                failed[lora_id] = exc
        return self.activate(lora_ids - failed.keys()), failed

    def _reload(self, lora_id: int, step_ids: set[int] | None, also_keep: Collection[int] = ()) -> None:
        """Read an evicted adapter again. Its registered content is the only one it may serve: files
        gone -> LoRAAdapterGoneError; other content, or files that no longer load ->
        LoRAAdapterChangedError (remembered until the files change again, so its requests fail fast)."""
        with self._lock:
            if lora_id in self._host:
                return
            lora_request, digest = self._registry.requests[lora_id], self._registry.digests[lora_id]
        if lora_request.is_mix:
            self._reload_mix(lora_request, digest, step_ids, also_keep)
            return
        name, key = lora_request.lora_name, _changed_key(lora_id)
        folder = self._locations.known_folder(lora_request) or lora_request.lora_path
        files = self._failed.check(key, folder)
        try:
            reloaded = self.load(lora_request, protected=step_ids, also_keep=also_keep)
        except LoRAAdapterError as e:
            if not os.path.isdir(folder):
                raise LoRAAdapterGoneError(
                    f"LoRA adapter '{name}' is registered but its files are gone from disk; unload it, "
                    "or put its files back."
                ) from None
            reason = str(e).removeprefix(f"LoRA adapter '{name}': ")
            raise LoRAAdapterChangedError(
                f"LoRA adapter '{name}' changed on disk since it was loaded and no longer loads ({reason}); "
                "unload it and load it again once its files are fixed."
            ) from None
        if reloaded.identity.digest != digest.result():
            with self._lock:
                self._drop(lora_id)
            error = LoRAAdapterChangedError(
                f"LoRA adapter '{name}' changed on disk since it was loaded; its new weights are not "
                "served under the old load: unload it and load it again to serve them."
            )
            self._failed.record(key, files, error)
            raise error
        self._failed.forget(key)

    def _reload_mix(
        self,
        lora_request: LoRARequest,
        digest: PendingDigest,
        step_ids: set[int] | None,
        also_keep: Collection[int],
    ) -> None:
        """Build an evicted mix again from its components (each from the host cache, else its files);
        a component whose content changed makes another mix, which is not served under this one."""
        reloaded = self.load(lora_request, protected=step_ids, also_keep=also_keep)
        if reloaded.identity.digest != digest.result():
            with self._lock:
                self._drop(lora_request.lora_id)
            raise LoRAAdapterChangedError(
                f"LoRA mix '{lora_request.lora_name}': one of its adapters changed since the mix was first "
                "served; request the mix again by its adapters' names to serve their new weights."
            )

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

    def _prefetch_one(self, lora_id: int) -> bool:
        """Bring one queued adapter back (prefetch thread): read it as the step would (`_reload`),
        evicting none the step uses or the queue needs sooner, then into a free slot. True if it did."""
        with self._lock:
            if lora_id not in self._registry.requests or lora_id in self._registry.pending_removals:
                return False
            needed = self._host.needed
            sooner = needed[: needed.index(lora_id)] if lora_id in needed else needed
            did = lora_id not in self._host
        if did:
            self._reload(lora_id, None, sooner)  # None: the step as it is when the read is done
        with self._lock:
            lora_model = self._host.peek(lora_id)
            if lora_model is not None and self._slots.slot_of(lora_id) is None and self._slots.has_free:
                self._admit(lora_model)
                did = True
        return did

    def wait_prefetch_idle(self, timeout: float | None = None) -> bool:
        """Wait until the prefetch thread has nothing left to read (True; False after `timeout`)."""
        return self._prefetcher is None or self._prefetcher.wait_idle(timeout)

    def end_step(self) -> None:
        """The step is over: its adapters may be evicted again (their requests reload them if needed)."""
        with self._lock:
            self._in_use = frozenset()

    def check_consistency(self) -> str | None:
        """What is wrong with the slot bookkeeping between steps; None if it is consistent."""
        with self._lock:
            if self._in_use:
                return f"LoRA adapters {sorted(self._in_use)} are still marked in use after the step"
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
            self._in_use = frozenset(lora_ids)
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
        lora_id = lora_request.lora_id
        with self._flights.hold(lora_id):  # a per-id lock: loads of other adapters go on
            with self._lock:
                cached = self._host.hit(lora_id)  # maybe read by the thread this one waited for
            if cached is not None:
                return cached
            lora_model, elapsed = self._read(lora_request)
            self._costs.observe(source_of(lora_model.path), lora_model.num_bytes, elapsed)
            with self._lock:
                if lora_model.uses_dora:
                    self._dora_ids = self._dora_ids | {lora_id}
                if lora_model.replaces_rows:
                    self._replacing_ids = self._replacing_ids | {lora_id}
                step = self._in_use if protected is None else frozenset(protected)
                keep = self._slots.pinned_ids | step | self._retained | frozenset(also_keep)
                return self._put(lora_model, keep, elapsed)

    def _read(self, lora_request: LoRARequest) -> tuple[LoRAModel, float]:
        """The adapter read and validated (`read_adapter`), and the seconds it took, in one line:
        its local folder (`~` expanded, a Hub repo downloaded), the memory of broken files (the same
        files fail again at once, after a few stats), the read. A failure is counted and leaves no
        trace, its location included; a failure of these files is remembered."""
        if lora_request.is_mix:
            return self._read_mix(lora_request)
        key = (lora_request.lora_name, lora_request.lora_path)
        start = time.perf_counter()
        try:
            folder = self._locations.local_path(lora_request)
            files = self._failed.check(key, folder)  # passing it drops any memory of other files
            try:
                lora_model = read_adapter(folder, lora_request, self._targets, self._limits)
            except LoRAAdapterError as error:
                self._failed.record(key, files, error)
                raise
        except BaseException:
            self._locations.forget(lora_request.lora_id)
            with self._lock:
                self._host.count_failure()
            raise
        return lora_model, time.perf_counter() - start

    def _read_mix(self, lora_request: LoRARequest) -> tuple[LoRAModel, float]:
        """A mix's virtual adapter (`lora.mix`), built from its components as they are loaded (each
        component is loaded, and cached, like any adapter; none of the step's adapters is evicted)."""
        start = time.perf_counter()
        parts = [(self.load(component), weight) for component, weight in lora_request.mix]
        try:
            mixed = mix_adapters(lora_request, parts, self.lora_config.max_lora_rank)
        except LoRAAdapterError:
            with self._lock:
                self._host.count_failure()
            raise
        return mixed, time.perf_counter() - start

    def _put(self, lora_model: LoRAModel, keep: Collection[int], elapsed: float) -> LoRAModel:
        """Cache a fresh read (evicted adapters leave their slots) and upload it to a free slot; the
        adapter already cached under its id if another load got there first (under the lock)."""
        try:
            evicted = self._host.add(lora_model, keep)
            if evicted is None:
                return self._host.peek(lora_model.lora_id) or lora_model
            for lora_id in evicted:
                self._slots.release(lora_id)
            try:
                self._admit(lora_model)
            except Exception:
                self._host.remove(lora_model.lora_id)
                raise
        except Exception:
            self._host.count_failure()
            raise
        self._host.count_load(elapsed)
        return lora_model

    def get_adapter(self, lora_id: int) -> LoRAModel | None:
        with self._lock:
            return self._host.peek(lora_id)

    def slot_of(self, lora_id: int) -> int | None:
        with self._lock:
            return self._slots.slot_of(lora_id)

    def _admit(self, lora_model: LoRAModel) -> None:
        """Upload a freshly loaded adapter to a free slot now, on the loading thread (while its digest
        is still being hashed on others), so that its first step finds it in place."""
        try:
            self._slots.place_if_free(lora_model)
        except Exception as e:
            raise LoRAAdapterError(f"LoRA adapter '{lora_model.name}' does not fit a slot: {e}") from None

    # ---- metrics (any thread) -------------------------------------------------------------------
    def resident_adapters(self) -> dict[str, list[str]]:
        """Adapter names by residency level, each list sorted and without repeats: "host" = in host
        memory, "slot" = in a compute slot. A slot holds only adapters that are in host memory, so
        every "slot" name is also a "host" name (an adapter replaced in place may appear twice
        under one name while its old requests finish: it is listed once). Mixes are listed as
        MIX_LABEL: their names hold clients' weights."""
        with self._lock:
            host, slot = set(), set()
            for lora_id in self._host.ids():
                lora_model = self._host.peek(lora_id)
                if lora_model is None:
                    continue
                name = MIX_LABEL if lora_model.path.startswith(MIX_PATH_PREFIX) else lora_model.name
                host.add(name)
                if self._slots.slot_of(lora_id) is not None:
                    slot.add(name)
            return {"slot": sorted(slot), "host": sorted(host)}

    def resident_versions(self) -> dict[str, str]:
        """Registered adapters held in memory, by `LoRARequest.version_key` of their digest ("name@<12
        digits>") -> "slot" or "host": what a replica tells the router, so that two versions of one
        name are never taken for each other. Digests still hashing are left out. Any thread."""
        with self._lock:
            levels: dict[str, str] = {}
            for lora_id in self._host.ids():
                lora_request = self._registry.requests.get(lora_id)
                pending = self._registry.digests.get(lora_id)
                if lora_request is None or pending is None or lora_request.is_mix or not pending.done():
                    continue
                key = version_key(lora_request.lora_name, pending.result())
                levels[key] = "slot" if self._slots.slot_of(lora_id) is not None else "host"
            return levels

    def stats(self) -> dict[str, int | float | str | list[float]]:
        """Counters and occupancy, keys prefixed `lora_`; `lora_load_seconds` lists the disk load
        latencies observed since the previous call (a histogram's new observations)."""
        with self._lock:
            counters = {**asdict(self._host.counters), **asdict(self._slots.counters)}
            out: dict[str, int | float | str | list[float]] = {f"lora_{k}": v for k, v in counters.items()}
            out["lora_eviction_policy"] = self._host.policy
            out["lora_num_cached"] = self._host.num_cached
            out["lora_num_loading"] = len(self._flights)
            out["lora_num_active_slots"] = self._slots.num_used
            out["lora_num_pinned"] = len(self._slots.pinned_ids)
            out["lora_load_seconds"] = self._host.drain_latencies()
            if self._prefetcher is not None:
                out.update({f"lora_{k}": v for k, v in asdict(self._prefetcher.counters).items()})
            return out


def _changed_key(lora_id: int) -> tuple[str, int]:
    """The FailedLoads key of a registered adapter found changed on disk."""
    return ("changed", lora_id)
