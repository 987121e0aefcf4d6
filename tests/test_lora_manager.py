"""LoRAModelManager: host LRU, slot LRU, pinning, in-use protection, failed and concurrent loads."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest
import safetensors.torch
import torch
from torch import nn

from loraserve.config import LoRAConfig
from loraserve.errors import LoRAAdapterError
from loraserve.layers.linear import Linear
from loraserve.lora.lora_model import LoRAModel
from loraserve.lora.manager import LoRAModelManager
from loraserve.lora.peft_helper import PEFTHelper
from loraserve.lora.request import LoRARequest
from loraserve.lora.weights import LoRALayerWeights, PackedLoRALayerWeights

H, KV, INTER, RANK = 16, 8, 24, 4


class _Attn(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.qkv_proj = Linear(H, [H, KV, KV])
        self.o_proj = Linear(H, H)


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.gate_up_proj = Linear(H, [INTER, INTER])
        self.down_proj = Linear(INTER, H)


class _Layer(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.self_attn = _Attn()
        self.mlp = _Mlp()


class _Inner(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList([_Layer(), _Layer()])


class StandInLlama(nn.Module):
    """Linear layers named like a Llama model (the manager only looks at those)."""

    packed_modules_mapping = {
        "qkv_proj": ["q_proj", "k_proj", "v_proj"],
        "gate_up_proj": ["gate_proj", "up_proj"],
    }

    def __init__(self) -> None:
        super().__init__()
        self.model = _Inner()
        self.lm_head = Linear(H, 50)
        for p in self.parameters():
            nn.init.normal_(p)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for layer in range(2):
        for module, d_in, d_out in (
            ("self_attn.q_proj", H, H),
            ("self_attn.v_proj", H, KV),
            ("mlp.down_proj", INTER, H),
        ):
            prefix = f"base_model.model.model.layers.{layer}.{module}"
            out[f"{prefix}.lora_A.weight"] = torch.randn(RANK, d_in, generator=g)
            out[f"{prefix}.lora_B.weight"] = torch.randn(d_out, RANK, generator=g)
    return out


CONFIG = {
    "peft_type": "LORA",
    "r": RANK,
    "lora_alpha": 8,
    "target_modules": ["q_proj", "v_proj", "down_proj"],
}


def _adapter(model: nn.Module, adapter_id: int) -> LoRAModel:
    name = f"ad{adapter_id}"
    helper = PEFTHelper.from_dict(CONFIG, name, max_lora_rank=8)
    return LoRAModel.from_tensors(
        _tensors(adapter_id), LoRARequest(name, adapter_id, ""), helper, model, torch.float32
    )


def _manager(max_loras: int, max_cpu_loras: int, ids: range | list[int] = range(0)) -> LoRAModelManager:
    model = StandInLlama()
    manager = LoRAModelManager(model, LoRAConfig(max_loras=max_loras, max_cpu_loras=max_cpu_loras, max_lora_rank=8),
                               torch.float32, "cpu")  # fmt: skip
    for i in ids:
        assert manager.add_adapter(_adapter(model, i))
    return manager


def _slot_holds(manager: LoRAModelManager, slot: int, adapter_id: int | None) -> bool:
    """Whether slot `slot` of layer 0's qkv buffers holds adapter_id's v_proj B (scaling folded in),
    or is all zeros for None."""
    layer = manager.modules["model.layers.0.self_attn.qkv_proj"]
    b_v = layer.lora_b_stacked[slot, H + KV :, 2 * 8 : 2 * 8 + RANK]
    if adapter_id is None:
        return not layer.lora_a_stacked[slot].any() and not layer.lora_b_stacked[slot].any()
    expected = _tensors(adapter_id)["base_model.model.model.layers.0.self_attn.v_proj.lora_B.weight"] * (
        8 / RANK
    )
    return torch.allclose(b_v, expected)


def test_add_remove_twice_and_list() -> None:
    manager = _manager(2, 3, [1, 2])
    model = manager.model
    assert not manager.add_adapter(_adapter(model, 1))
    assert list(manager.list_adapters()) == [1, 2] and manager.has_adapter(2)
    slot = manager.activate({2})[2]
    assert _slot_holds(manager, slot, 2)
    assert manager.remove_adapter(2) and not manager.remove_adapter(2)
    assert manager.slot_of(2) is None and list(manager.list_adapters()) == [1]
    assert _slot_holds(manager, slot, None)


def test_slot_lru_and_in_use_never_evicted() -> None:
    manager = _manager(2, 4, [1, 2, 3])
    s1 = manager.activate({1})[1]
    s2 = manager.activate({2})[2]
    assert s1 != s2 and manager.activate({1}) == {1: s1}  # hit, 1 is now the most recent
    assert manager.activate({3}) == {3: s2}  # 2 was least recently used
    assert manager.slot_of(2) is None and _slot_holds(manager, s2, 3) and _slot_holds(manager, s1, 1)
    manager.activate({3})  # now 1 is the least recently used slot...
    assert manager.activate({1, 2}) == {1: s1, 2: s2}  # ...but the step needs 1, so 3 goes
    counters = manager.counters
    assert (counters.num_slot_loads, counters.num_slot_evictions, counters.num_slot_hits) == (4, 2, 3)
    with pytest.raises(ValueError, match="needs 3 LoRA slots"):
        manager.activate({1, 2, 3})
    with pytest.raises(ValueError, match=r"\[9\] are not loaded"):
        manager.activate({9})


def test_pinning() -> None:
    manager = _manager(3, 5, [1, 2, 3, 4])
    assert manager.pin_adapter(1) and not manager.pin_adapter(1) and manager.pin_adapter(2)
    with pytest.raises(ValueError, match="pinning every slot"):
        manager.pin_adapter(3)
    with pytest.raises(ValueError, match="not loaded"):
        manager.pin_adapter(7)
    pinned_slots = {manager.slot_of(1), manager.slot_of(2)}
    assert None not in pinned_slots
    manager.activate({3})
    manager.activate({4})  # evicts 3, never a pinned adapter
    assert manager.slot_of(3) is None and {manager.slot_of(1), manager.slot_of(2)} == pinned_slots
    assert not manager.can_activate({3, 4}) and manager.can_activate({1, 2, 4})
    with pytest.raises(ValueError, match="not held by pinned adapters"):
        manager.activate({3, 4})
    for i in (5, 6, 7):  # host cache of 5: pinned adapters stay cached
        manager.add_adapter(_adapter(manager.model, i))
    assert {1, 2} <= set(manager.list_adapters()) and len(manager.list_adapters()) == 5
    assert manager.remove_adapter(1) and manager.pin_adapter(7)  # removal released the pin


def test_host_eviction_frees_slot_and_spares_step() -> None:
    manager = _manager(2, 2, [1, 2])
    s1 = manager.activate({1})[1]
    manager.activate({2})  # host LRU order: 1, 2; the running step uses 2
    assert manager.add_adapter(_adapter(manager.model, 3))
    assert list(manager.list_adapters()) == [2, 3] and manager.slot_of(1) is None
    assert _slot_holds(manager, s1, None)
    assert manager.add_adapter(_adapter(manager.model, 4))  # 2 is in use: 3 goes although newer
    assert list(manager.list_adapters()) == [2, 4]
    manager.activate({2, 4})
    with pytest.raises(ValueError, match="holds only pinned adapters or adapters of the step"):
        manager.add_adapter(_adapter(manager.model, 5))
    assert manager.counters.num_host_evictions == 2


def _write_adapter(folder: Path, seed: int, **config: object) -> Path:
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text(json.dumps({**CONFIG, **config}))
    safetensors.torch.save_file(_tensors(seed), str(folder / "adapter_model.safetensors"))
    return folder


def test_load_and_add_failure_leaves_nothing(tmp_path: Path) -> None:
    manager = _manager(2, 2)
    good = _write_adapter(tmp_path / "good", 1)
    bad = _write_adapter(tmp_path / "bad", 2, r=16)  # above max_lora_rank=8
    with pytest.raises(LoRAAdapterError, match="greater than max_lora_rank"):
        manager.load_and_add(LoRARequest("bad", 2, str(bad)))
    assert manager.list_adapters() == {} and manager.counters.num_load_failures == 1
    loaded = manager.load_and_add(LoRARequest("good", 1, str(good)))
    assert manager.load_and_add(LoRARequest("good", 1, str(good))) is loaded
    stats = manager.stats()
    assert stats["lora_num_loads"] == 1 and stats["lora_num_host_hits"] == 1 and stats["lora_num_cached"] == 1
    assert len(manager.drain_load_latencies()) == 1 and manager.drain_load_latencies() == []


def test_protected_ids_stay_cached(tmp_path: Path) -> None:
    manager = _manager(2, 2, [1, 2])
    folder = _write_adapter(tmp_path / "three", 3)
    with pytest.raises(ValueError, match="host cache"):
        manager.load_and_add(LoRARequest("three", 3, str(folder)), protected={1, 2})
    assert list(manager.list_adapters()) == [1, 2]
    manager.load_and_add(LoRARequest("three", 3, str(folder)), protected={2})
    assert list(manager.list_adapters()) == [2, 3]


def test_concurrent_first_requests_load_once(tmp_path: Path) -> None:
    manager = _manager(2, 4)
    folder = _write_adapter(tmp_path / "shared", 1)
    request = LoRARequest("shared", 1, str(folder))
    results: list[LoRAModel] = []
    barrier = threading.Barrier(6)

    def load() -> None:
        barrier.wait()
        results.append(manager.load_and_add(request))

    threads = [threading.Thread(target=load) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(results) == 6 and all(r is results[0] for r in results)
    assert manager.counters.num_loads == 1 and manager._load_locks == {}


def _slot_is_clean(manager: LoRAModelManager, slot: int) -> bool:
    """Every buffer row of `slot` is zero and no layer records a rank or activity there."""
    for layer in manager.modules.values():
        if layer.lora_a_stacked[slot].any() or layer.lora_b_stacked[slot].any():
            return False
        if layer.lora_slices.ranks[slot].any() or layer._state.active_mask & (1 << slot):
            return False
    return True


@pytest.mark.parametrize("cpu_kernel", ["1", "0"])
def test_activation_refused_midway_leaves_a_clean_free_slot(cpu_kernel: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASERVE_CPU_LORA_KERNEL", cpu_kernel)
    manager = _manager(2, 4, [1, 2])
    manager.activate({1})
    manager.activate({2})
    victim_slot = manager.slot_of(2)
    # An adapter whose last module does not fit its layer: earlier layers are written, then refused.
    broken = _adapter(manager.model, 3)
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
    assert manager.add_adapter(broken)
    # Adapter 2's slot is the LRU victim: layer 0 gets adapter 3, then layer 1 refuses it, so the
    # slot holds parts of both when the manager cleans it up.
    with pytest.raises(ValueError, match="does not fit"):
        manager.activate({1, 3})
    assert victim_slot is not None and manager.slot_of(2) is None and manager.slot_of(3) is None
    assert _slot_is_clean(manager, victim_slot)
    slot_1 = manager.slot_of(1)
    assert slot_1 is not None and _slot_holds(manager, slot_1, 1)  # the other slot is untouched
