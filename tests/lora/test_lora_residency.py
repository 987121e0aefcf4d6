"""`LoRAManager.resident_adapters()`: which adapters are in a compute slot and which in host memory, by
name (what a replica reports to the adapter-affinity router of `serve --replicas`, and /metrics)."""

from __future__ import annotations

from pathlib import Path

import torch
from support.stand_in_model import StandInLlama, write_stand_in_adapter

from loraserve.config import LoRAConfig
from loraserve.lora.manager import LoRAManager
from loraserve.lora.request import LoRARequest


def _request(root: Path, lora_id: int) -> LoRARequest:
    folder = root / f"ad{lora_id}"
    write_stand_in_adapter(folder, lora_id)
    return LoRARequest(f"ad{lora_id}", lora_id, str(folder))


def test_residency_follows_slots_and_host_evictions(tmp_path: Path) -> None:
    config = LoRAConfig(max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    manager = LoRAManager(StandInLlama(), config, torch.float32, "cpu")
    assert manager.resident_adapters() == {"slot": [], "host": []}
    manager.load(_request(tmp_path, 1))  # a free slot: uploaded at once
    manager.load(_request(tmp_path, 2))  # the only slot is taken: host memory only
    assert manager.resident_adapters() == {"slot": ["ad1"], "host": ["ad1", "ad2"]}
    manager.activate({2})  # the step needs ad2: it takes the slot from ad1
    manager.end_step()
    assert manager.resident_adapters() == {"slot": ["ad2"], "host": ["ad1", "ad2"]}
    manager.load(_request(tmp_path, 3))  # the host cache holds 2: the least recent (ad1) goes
    assert manager.resident_adapters() == {"slot": ["ad2"], "host": ["ad2", "ad3"]}
