"""Adapter lifecycle: the slot table (slot LRU, pinning, refused writes) and the LoRAManager facade over
it and the host cache (registration, removal, failed and concurrent loads, in-step protection), all
through their public APIs. The LRU, the host cache and single flight: test_lru.py, test_host_cache.py,
test_single_flight.py."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch
from support.stand_in_model import KV, RANK, H, StandInLlama, stand_in_lora_model, write_stand_in_adapter
from support.stand_in_model import stand_in_tensors as _tensors
from torch import nn

from loraserve.config import LoRAConfig
from loraserve.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from loraserve.lora.layers import LinearWithLoRA, wrap_model_for_lora
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.manager import LoRAManager
from loraserve.lora.request import LoRARequest
from loraserve.lora.slot_table import SlotTable
from loraserve.lora.weights import LoRALayerWeights, PackedLoRALayerWeights


def _holds(model: StandInLlama, slot: int, lora_id: int | None) -> bool:
    """Whether slot `slot` of layer 0's qkv buffers holds adapter lora_id's v_proj B (scaling folded
    in), or is all zeros for None."""
    layer = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer, LinearWithLoRA)
    if lora_id is None:
        return not layer.lora_a_stacked[slot].any() and not layer.lora_b_stacked[slot].any()
    b_v = layer.lora_b_stacked[slot, H + KV :, 2 * 8 : 2 * 8 + RANK]
    expected = _tensors(lora_id)["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"] * (8 / RANK)
    return torch.allclose(b_v, expected)


def _is_clean(model: nn.Module, slot: int) -> bool:
    """Every buffer row of `slot` is zero and no layer records a rank or an adapter there."""
    for layer in model.modules():
        if isinstance(layer, LinearWithLoRA):
            buffers = layer.lora_buffers
            if buffers.lora_a[slot].any() or buffers.lora_b[slot].any() or buffers.ranks[slot].any():
                return False
            if buffers.active_mask & (1 << slot):
                return False
    return True


# ---- SlotTable -----------------------------------------------------------------------------------
def _slot_table(max_loras: int, ids: list[int]) -> tuple[SlotTable, StandInLlama, dict[int, LoRAModel]]:
    model = StandInLlama()
    layers = wrap_model_for_lora(model, LoRAConfig(max_loras=max_loras, max_lora_rank=8))
    return SlotTable(layers, max_loras), model, {i: stand_in_lora_model(model, i) for i in ids}


def test_slot_lru_never_evicts_kept_adapters() -> None:
    table, model, adapters = _slot_table(2, [1, 2, 3])
    s1 = table.acquire(adapters[1], keep={1})
    s2 = table.acquire(adapters[2], keep={2})
    assert s1 != s2 and table.acquire(adapters[1], keep={1}) == s1  # a hit: 1 is now the most recent
    assert table.acquire(adapters[3], keep={3}) == s2  # 2 was least recently used
    assert table.slot_of(2) is None and _holds(model, s2, 3) and _holds(model, s1, 1)
    table.acquire(adapters[3], keep={3})  # now 1 is the least recently used slot...
    assert table.acquire(adapters[2], keep={1, 2}) == s2  # ...but the step needs 1, so 3 goes
    counters = table.counters
    assert (counters.num_slot_loads, counters.num_slot_evictions, counters.num_slot_hits) == (4, 2, 2)
    with pytest.raises(ValueError, match="no free LoRA slot for adapter 'ad3'"):
        table.acquire(adapters[3], keep={1, 2})


def test_pinning() -> None:
    table, _, adapters = _slot_table(3, [1, 2, 3, 4])
    assert table.pin(adapters[1], keep=()) and not table.pin(adapters[1], keep=())
    assert table.pin(adapters[2], keep=())
    with pytest.raises(ValueError, match="'ad3'.*pinning every slot"):
        table.pin(adapters[3], keep=())
    pinned_slots = {table.slot_of(1), table.slot_of(2)}
    assert None not in pinned_slots and table.pinned_ids == {1, 2}
    table.acquire(adapters[3], keep={3})
    table.acquire(adapters[4], keep={4})  # evicts 3, never a pinned adapter
    assert table.slot_of(3) is None and {table.slot_of(1), table.slot_of(2)} == pinned_slots
    assert not table.can_fit({3, 4}) and table.can_fit({1, 2, 4})
    table.release(1)  # releasing drops the pin
    assert table.pinned_ids == {2} and table.pin(adapters[3], keep=())


@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
def test_write_refused_midway_leaves_a_clean_free_slot(cpu_kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    table, model, adapters = _slot_table(2, [1, 2, 3])
    table.acquire(adapters[1], keep={1})
    victim_slot = table.acquire(adapters[2], keep={2})
    # An adapter whose last module does not fit its layer: earlier layers are written, then refused.
    broken = adapters[3]
    last = "model.layers.1.mlp.down_proj"
    good = broken.loras[last]
    assert not isinstance(good, PackedLoRALayerWeights)
    broken.loras[last] = LoRALayerWeights(last, RANK, good.lora_a[:, :-1], good.lora_b, good.scaling)
    # Lower ranks than adapter 2 in layer 0, so writing it there must also zero adapter 2's extra rows.
    for name, weights in list(broken.loras.items()):
        if name.startswith("model.layers.0."):
            parts = weights.slices if isinstance(weights, PackedLoRALayerWeights) else [weights]
            for part in parts:
                if part is not None:
                    part.rank, part.lora_a, part.lora_b = 2, part.lora_a[:2], part.lora_b[:, :2]
    # Adapter 2's slot is the LRU victim: layer 0 gets adapter 3, then layer 1 refuses it, so the
    # slot holds parts of both when the table cleans it up.
    table.acquire(adapters[1], keep={1})
    with pytest.raises(ValueError, match="does not fit"):
        table.acquire(broken, keep={1, 3})
    assert table.slot_of(2) is None and table.slot_of(3) is None and table.num_used == 1
    assert _is_clean(model, victim_slot)
    slot_1 = table.slot_of(1)
    assert slot_1 is not None and _holds(model, slot_1, 1)  # the other slot is untouched
    assert table.acquire(adapters[2], keep={2}) == victim_slot  # the slot is free again


# ---- LoRAManager ---------------------------------------------------------------------------------
@pytest.fixture
def adapter_dir(tmp_path: Path):  # type: ignore[no-untyped-def]
    """request(lora_id, **config): an adapter written to disk once per id."""

    def request(lora_id: int, **config: object) -> LoRARequest:
        folder = tmp_path / f"ad{lora_id}"
        if not folder.exists():
            write_stand_in_adapter(folder, lora_id, **config)
        return LoRARequest(f"ad{lora_id}", lora_id, str(folder))

    return request


def _manager(max_loras: int, max_cpu_loras: int, eviction_policy: str | None = None) -> tuple[LoRAManager, StandInLlama]:
    model = StandInLlama()
    config = LoRAConfig(
        max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=8, lora_eviction_policy=eviction_policy
    )
    return LoRAManager(model, config, torch.float32, "cpu"), model


def test_register_remove_and_list(adapter_dir) -> None:  # type: ignore[no-untyped-def]
    manager, model = _manager(2, 3)
    digest = manager.register(adapter_dir(1)).result()
    assert manager.register(adapter_dir(1)).result() == digest
    assert manager.register(adapter_dir(2)).result() != digest
    with pytest.raises(LoRAAdapterError, match="already registered as 'ad1'"):
        manager.register(LoRARequest("other", 1, adapter_dir(2).lora_path))
    assert [r.lora_name for r in manager.list_requests()] == ["ad1", "ad2"]
    slot = manager.activate({2})[2]
    assert _holds(model, slot, 2)
    manager.end_step()
    assert manager.remove(2, in_use=False) and not manager.remove(2, in_use=False)
    assert manager.removal(2).done() and manager.slot_of(2) is None and _holds(model, slot, None)
    assert [r.lora_name for r in manager.list_requests()] == ["ad1"] and manager.stats()["lora_num_cached"] == 1
    with pytest.raises(LoRAAdapterNotFoundError, match="unloaded"):
        manager.register(adapter_dir(2))  # a request that resolved it before the unload
    manager.register(adapter_dir(2), explicit=True)  # an explicit add lifts the unload
    assert manager.is_registered(2)


def test_concurrent_first_loads_read_once(adapter_dir, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    """Six threads ask for one cold adapter at once: one disk read, the others wait for it (hits)."""
    import loraserve.lora.adapter_loader as loader_module

    manager, _ = _manager(2, 3)
    request, reads = adapter_dir(1), []
    real_read = loader_module.read_adapter

    def counting_read(*args: object) -> LoRAModel:
        reads.append(1)
        return real_read(*args)  # type: ignore[arg-type]

    monkeypatch.setattr(loader_module, "read_adapter", counting_read)
    barrier, results = threading.Barrier(6), []

    def load() -> None:
        barrier.wait()
        results.append(manager.load(request))

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stats = manager.stats()
    assert len(reads) == 1 and len(results) == 6 and all(r is results[0] for r in results)
    assert stats["lora_num_loads"] == 1 and stats["lora_num_host_hits"] == 5
    assert stats["lora_num_loading"] == 0


def test_deferred_removal_completes_when_unused(adapter_dir) -> None:  # type: ignore[no-untyped-def]
    manager, _ = _manager(2, 2)
    manager.register(adapter_dir(1))
    assert manager.remove(1, in_use=True) and manager.has_pending_removals
    done = manager.removal(1)
    assert not done.done() and manager.list_requests() == [] and not manager.remove(1, in_use=True)
    with pytest.raises(LoRAAdapterNotFoundError):
        manager.register(adapter_dir(1), explicit=True)
    manager.finish_removals({1})
    assert not done.done()
    manager.finish_removals(set())
    assert done.done() and not manager.is_registered(1) and manager.stats()["lora_num_cached"] == 0


def test_activation_limits_and_pins(adapter_dir) -> None:  # type: ignore[no-untyped-def]
    manager, _ = _manager(3, 5)
    for i in (1, 2, 3, 4):
        manager.register(adapter_dir(i))
    assert manager.pin(1) and not manager.pin(1) and manager.pin(2)
    with pytest.raises(LoRAAdapterError, match="not registered"):
        manager.pin(7)
    assert not manager.can_activate({3, 4}) and manager.can_activate({1, 2, 4})
    with pytest.raises(ValueError, match="needs 2 LoRA slots but only 1"):
        manager.activate({3, 4})
    with pytest.raises(ValueError, match=r"\[9\] are not loaded"):
        manager.activate({9})
    stats = manager.stats()
    assert stats["lora_num_pinned"] == 2 and stats["lora_num_active_slots"] == 3


def test_host_eviction_frees_slot_and_spares_step(adapter_dir) -> None:  # type: ignore[no-untyped-def]
    manager, model = _manager(2, 2)
    manager.load(adapter_dir(1))
    manager.load(adapter_dir(2))  # loads go straight into free slots
    s1 = manager.activate({1})[1]
    manager.activate({2})  # host LRU order: 1, 2; the running step uses 2
    manager.load(adapter_dir(3))  # evicts 1, and takes its slot
    assert manager.get_adapter(1) is None and manager.slot_of(1) is None and _holds(model, s1, 3)
    manager.load(adapter_dir(4))  # 2 is in use: 3 goes although newer
    assert [i for i in (1, 2, 3, 4) if manager.get_adapter(i)] == [2, 4]
    manager.activate({2, 4})
    with pytest.raises(ValueError, match="no room in host memory"):
        manager.load(adapter_dir(5))
    with pytest.raises(ValueError, match="host cache"):
        manager.load(adapter_dir(5), protected={2, 4})
    manager.load(adapter_dir(5), protected={4})
    stats = manager.stats()
    assert stats["lora_num_host_evictions"] == 3 and stats["lora_num_load_failures"] == 2


def test_host_cache_keeps_what_the_queue_needs(adapter_dir) -> None:  # type: ignore[no-untyped-def]
    """The host LRU is ordered by request arrivals (each a counted hit when the adapter is cached),
    not by the steps that ran them; an adapter queued requests need goes only when all are needed.
    Plain LRU: the cost policy's order follows measured load times (tests/lora/test_eviction.py)."""
    manager, _ = _manager(1, 3, eviction_policy="lru")
    queue: list[int] = []  # the adapters the queue needs, soonest first (the scheduler's answer)
    manager.follow_demand(lambda: queue)

    def host() -> list[str]:
        return manager.resident_adapters()["host"]

    for i in (1, 2, 3):
        manager.register(adapter_dir(i))
    manager.activate({3})  # a step ran 3, and 1 and 2 not at all: no reordering
    manager.end_step()
    manager.register(adapter_dir(1))  # a request for 1 arrives: a host hit, 1 is the most recent
    manager.register(adapter_dir(4))  # 2 is the least recently requested: it goes
    assert host() == ["ad1", "ad3", "ad4"] and manager.stats()["lora_num_host_hits"] == 1
    queue[:] = [3]  # a request for 3 waits (plain LRU would take 3, the least recently requested)
    manager.register(adapter_dir(5))
    assert host() == ["ad3", "ad4", "ad5"]
    queue[:] = [4, 5, 3]  # all needed: 3, needed last, goes
    manager.register(adapter_dir(6))
    assert host() == ["ad4", "ad5", "ad6"]
    queue[:] = [4, 2]  # a step needs 2 again: its reload evicts 5 or 6, never 4
    slots, failed = manager.prepare_step({2})
    manager.end_step()
    assert failed == {} and 2 in slots and "ad4" in host() and "ad2" in host()
    stats = manager.stats()
    assert stats["lora_num_loads"] == 7 and stats["lora_num_host_evictions"] == 4
    assert stats["lora_num_host_hits"] == 1


def test_load_failure_leaves_nothing(adapter_dir) -> None:  # type: ignore[no-untyped-def]
    manager, _ = _manager(2, 2)
    with pytest.raises(LoRAAdapterError, match="greater than max_lora_rank"):
        manager.register(adapter_dir(2, r=16))  # above max_lora_rank=8
    assert manager.get_adapter(2) is None and manager.list_requests() == []
    manager.register(adapter_dir(1))
    stats = manager.stats()
    assert stats["lora_num_load_failures"] == 1 and stats["lora_num_loads"] == 1
    assert stats["lora_num_cached"] == 1 and stats["lora_num_loading"] == 0
    assert len(stats["lora_load_seconds"]) == 1 and manager.stats()["lora_load_seconds"] == []  # drained


def test_prepare_step_reloads_evicted_adapters(adapter_dir) -> None:  # type: ignore[no-untyped-def]
    manager, model = _manager(1, 1)
    for i in (1, 2):
        manager.register(adapter_dir(i))  # 2 evicts 1 from the host cache
    assert manager.get_adapter(1) is None
    slots, failed = manager.prepare_step({1})
    assert failed == {} and _holds(model, slots[1], 1) and manager.stats()["lora_num_loads"] == 3
    manager.end_step()
    # New weights on disk under the same name fail that adapter's requests only.
    safetensors.torch.save_file(_tensors(7), str(Path(adapter_dir(2).lora_path) / "adapter_model.safetensors"))
    slots, failed = manager.prepare_step({2})
    assert slots == {} and "changed on disk" in str(failed[2]) and manager.get_adapter(2) is None
