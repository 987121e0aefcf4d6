"""What `LoRAManager` reports about its adapters: residency by name and by version, and its `lora_*`
stats. Plain reads of the manager's parts; the manager calls them under its lock."""

from __future__ import annotations

from dataclasses import asdict

from loraserve.lora.host_cache import HostCache
from loraserve.lora.mix import MIX_LABEL
from loraserve.lora.prefetch import Prefetcher
from loraserve.lora.registry import AdapterRegistry
from loraserve.lora.request import MIX_PATH_PREFIX, version_key
from loraserve.lora.single_flight import SingleFlight
from loraserve.lora.slot_table import SlotTable


def resident_adapters(host: HostCache, slots: SlotTable) -> dict[str, list[str]]:
    """`LoRAManager.resident_adapters`: {"slot": names, "host": names}, each sorted, no repeats."""
    host_names, slot_names = set(), set()
    for lora_id in host.ids():
        lora_model = host.peek(lora_id)
        if lora_model is None:
            continue
        name = MIX_LABEL if lora_model.path.startswith(MIX_PATH_PREFIX) else lora_model.name
        host_names.add(name)
        if slots.slot_of(lora_id) is not None:
            slot_names.add(name)
    return {"slot": sorted(slot_names), "host": sorted(host_names)}


def resident_versions(host: HostCache, registry: AdapterRegistry, slots: SlotTable) -> dict[str, str]:
    """`LoRAManager.resident_versions`: version key -> "slot" or "host", mixes and digests still
    hashing left out."""
    levels: dict[str, str] = {}
    for lora_id in host.ids():
        lora_request = registry.requests.get(lora_id)
        pending = registry.digests.get(lora_id)
        if lora_request is None or pending is None or lora_request.is_mix or not pending.done():
            continue
        key = version_key(lora_request.lora_name, pending.result())
        levels[key] = "slot" if slots.slot_of(lora_id) is not None else "host"
    return levels


def lora_stats(
    host: HostCache, slots: SlotTable, flights: SingleFlight, prefetcher: Prefetcher | None
) -> dict[str, int | float | str | list[float]]:
    """`LoRAManager.stats`: counters and occupancy, keys prefixed `lora_`; draining the host cache's
    load latencies (`lora_load_seconds`: those observed since the previous call)."""
    counters = {**asdict(host.counters), **asdict(slots.counters)}
    out: dict[str, int | float | str | list[float]] = {f"lora_{k}": v for k, v in counters.items()}
    out["lora_eviction_policy"] = host.policy
    out["lora_num_cached"] = host.num_cached
    out["lora_num_loading"] = len(flights)
    out["lora_num_active_slots"] = slots.num_used
    out["lora_num_pinned"] = len(slots.pinned_ids)
    out["lora_load_seconds"] = host.drain_latencies()
    if prefetcher is not None:
        out.update({f"lora_{k}": v for k, v in asdict(prefetcher.counters).items()})
    return out
