"""`AdapterLoader`: the read/load path of `LoRAManager`, from a `LoRARequest` to a cached adapter.

It owns no state of its own: the manager builds it with its lock and parts (registry, host cache,
slot table, locations, failed loads, reload costs, single flight) and the `AdapterSets` both read.
A load goes one way: the host cache, else the folder (`AdapterLocations`), the memory of broken
files (`FailedLoads`), `adapter_read.read_adapter` (or `mix.mix_adapters`), then the host cache and a
free slot. A reload of an evicted registered adapter checks its digest: it serves only the content
it was registered with. Disk reads run outside the lock; everything else under it, as the manager's.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Collection
from dataclasses import dataclass

from loraserve.errors import LoRAAdapterChangedError, LoRAAdapterError, LoRAAdapterGoneError
from loraserve.lora.adapter_path import AdapterLocations
from loraserve.lora.adapter_read import ReadLimits, read_adapter
from loraserve.lora.digest import PendingDigest
from loraserve.lora.eviction import ReloadCosts, source_of
from loraserve.lora.failed_loads import FailedLoads
from loraserve.lora.host_cache import HostCache
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.mix import mix_adapters
from loraserve.lora.registry import AdapterRegistry
from loraserve.lora.request import LoRARequest
from loraserve.lora.single_flight import SingleFlight
from loraserve.lora.slot_table import SlotTable
from loraserve.lora.targets import LoRATargets


@dataclass(slots=True)
class AdapterSets:
    """Id sets the manager and its loader share. Each is rebound (under the lock), never mutated, so
    that other threads may read it without the lock."""

    in_use: frozenset[int] = frozenset()  # the adapters of the step being prepared or run
    # Adapters being removed (unloaded or replaced in place) whose requests still run: their cached
    # copy may be the only one left (files deleted or overwritten), so the host cache keeps them.
    retained: frozenset[int] = frozenset()
    dora: frozenset[int] = frozenset()  # loaded adapters with DoRA scales
    replacing: frozenset[int] = frozenset()  # loaded adapters replacing vocab rows


@dataclass(frozen=True, slots=True)
class LoaderParts:
    """What a load reads and writes: the manager's lock and parts (shared, not copied)."""

    lock: threading.RLock
    registry: AdapterRegistry
    host: HostCache
    slots: SlotTable
    sets: AdapterSets
    locations: AdapterLocations
    failed: FailedLoads
    costs: ReloadCosts
    flights: SingleFlight
    targets: LoRATargets
    limits: ReadLimits
    max_lora_rank: int


def changed_key(lora_id: int) -> tuple[str, int]:
    """The FailedLoads key of a registered adapter found changed on disk."""
    return ("changed", lora_id)


class AdapterLoader:
    def __init__(self, parts: LoaderParts) -> None:
        self._p = parts

    def load(
        self,
        lora_request: LoRARequest,
        protected: Collection[int] | None = None,
        also_keep: Collection[int] = (),
    ) -> LoRAModel:
        """`LoRAManager.load`: the adapter from the host cache, else read, validated and cached."""
        p = self._p
        lora_id = lora_request.lora_id
        with p.flights.hold(lora_id):  # a per-id lock: loads of other adapters go on
            with p.lock:
                cached = p.host.hit(lora_id)  # maybe read by the thread this one waited for
            if cached is not None:
                return cached
            lora_model, elapsed = self.read(lora_request)
            p.costs.observe(source_of(lora_model.path), lora_model.num_bytes, elapsed)
            with p.lock:
                if lora_model.uses_dora:
                    p.sets.dora = p.sets.dora | {lora_id}
                if lora_model.replaces_rows:
                    p.sets.replacing = p.sets.replacing | {lora_id}
                step = p.sets.in_use if protected is None else frozenset(protected)
                keep = p.slots.pinned_ids | step | p.sets.retained | frozenset(also_keep)
                return self.put(lora_model, keep, elapsed)

    def read(self, lora_request: LoRARequest) -> tuple[LoRAModel, float]:
        """The adapter read and validated (`read_adapter`), and the seconds it took, in one line:
        its local folder (`~` expanded, a Hub repo downloaded), the memory of broken files (the same
        files fail again at once, after a few stats), the read. A failure is counted and leaves no
        trace, its location included; a failure of these files is remembered."""
        if lora_request.is_mix:
            return self._read_mix(lora_request)
        p = self._p
        key = (lora_request.lora_name, lora_request.lora_path)
        start = time.perf_counter()
        try:
            folder = p.locations.local_path(lora_request)
            files = p.failed.check(key, folder)  # passing it drops any memory of other files
            try:
                lora_model = read_adapter(folder, lora_request, p.targets, p.limits)
            except LoRAAdapterError as error:
                p.failed.record(key, files, error)
                raise
        except BaseException:
            p.locations.forget(lora_request.lora_id)
            with p.lock:
                p.host.count_failure()
            raise
        return lora_model, time.perf_counter() - start

    def _read_mix(self, lora_request: LoRARequest) -> tuple[LoRAModel, float]:
        """A mix's virtual adapter (`lora.mix`), built from its components as they are loaded (each
        component is loaded, and cached, like any adapter; none of the step's adapters is evicted)."""
        start = time.perf_counter()
        parts = [(self.load(component), weight) for component, weight in lora_request.mix]
        try:
            mixed = mix_adapters(lora_request, parts, self._p.max_lora_rank)
        except LoRAAdapterError:
            with self._p.lock:
                self._p.host.count_failure()
            raise
        return mixed, time.perf_counter() - start

    def put(self, lora_model: LoRAModel, keep: Collection[int], elapsed: float) -> LoRAModel:
        """Cache a fresh read (evicted adapters leave their slots) and upload it to a free slot; the
        adapter already cached under its id if another load got there first (under the lock)."""
        host = self._p.host
        try:
            evicted = host.add(lora_model, keep)
            if evicted is None:
                return host.peek(lora_model.lora_id) or lora_model
            for lora_id in evicted:
                self._p.slots.release(lora_id)
            try:
                self.admit(lora_model)
            except Exception:
                host.remove(lora_model.lora_id)
                raise
        except Exception:
            host.count_failure()
            raise
        host.count_load(elapsed)
        return lora_model

    def admit(self, lora_model: LoRAModel) -> None:
        """Upload a freshly loaded adapter to a free slot now, on the loading thread (while its digest
        is still being hashed on others), so that its first step finds it in place."""
        try:
            self._p.slots.place_if_free(lora_model)
        except Exception as e:
            raise LoRAAdapterError(f"LoRA adapter '{lora_model.name}' does not fit a slot: {e}") from None

    def drop(self, lora_id: int) -> None:
        """The adapter leaves the host cache and its slot (it stays registered). Under the lock."""
        self._p.host.remove(lora_id)
        self._p.slots.release(lora_id)
        self._p.sets.in_use = self._p.sets.in_use - {lora_id}

    def reload(self, lora_id: int, step_ids: set[int] | None, also_keep: Collection[int] = ()) -> None:
        """Read an evicted adapter again. Its registered content is the only one it may serve: files
        gone -> LoRAAdapterGoneError; other content, or files that no longer load ->
        LoRAAdapterChangedError (remembered until the files change again, so its requests fail fast)."""
        p = self._p
        with p.lock:
            if lora_id in p.host:
                return
            lora_request, digest = p.registry.requests[lora_id], p.registry.digests[lora_id]
        if lora_request.is_mix:
            self._reload_mix(lora_request, digest, step_ids, also_keep)
            return
        name, key = lora_request.lora_name, changed_key(lora_id)
        folder = p.locations.known_folder(lora_request) or lora_request.lora_path
        files = p.failed.check(key, folder)
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
            with p.lock:
                self.drop(lora_id)
            error = LoRAAdapterChangedError(
                f"LoRA adapter '{name}' changed on disk since it was loaded; its new weights are not "
                "served under the old load: unload it and load it again to serve them."
            )
            p.failed.record(key, files, error)
            raise error
        p.failed.forget(key)

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
            with self._p.lock:
                self.drop(lora_request.lora_id)
            raise LoRAAdapterChangedError(
                f"LoRA mix '{lora_request.lora_name}': one of its adapters changed since the mix was first "
                "served; request the mix again by its adapters' names to serve their new weights."
            )

    def prefetch_one(self, lora_id: int) -> bool:
        """Bring one queued adapter back (the `Prefetcher`'s work, on its thread): read it as the step
        would (`reload`), evicting none the step uses or the queue needs sooner, then into a free
        slot. True if it did."""
        p = self._p
        with p.lock:
            if lora_id not in p.registry.requests or lora_id in p.registry.pending_removals:
                return False
            did = lora_id not in p.host
        if did:  # None and a live view: the step and the queue as they are when the read is done
            self.reload(lora_id, None, p.host.needed_before(lora_id))
        with p.lock:
            lora_model = p.host.peek(lora_id)
            if lora_model is not None and p.slots.slot_of(lora_id) is None and p.slots.has_free:
                self.admit(lora_model)
                did = True
        return did
