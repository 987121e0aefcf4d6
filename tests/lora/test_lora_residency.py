"""Where adapters reside: `LoRAManager.resident_adapters()` (which are in a compute slot and which in
host memory, by name: what a replica reports to the adapter-affinity router of `serve --replicas`,
and /metrics), and whether the host cache holds under the engine's own access pattern (a random
trace through a real engine against an ideal LRU, `benchmarks.host_cache_trace`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from support.stand_in_model import StandInLlama, write_stand_in_adapter

from benchmarks.host_cache_trace import (
    HOST_ENTRIES,
    NUM_ADAPTERS,
    adapter_requests,
    lru_reads,
    run_trace,
    trace_engine,
    uniform_trace,
)
from loraserve.config import LoRAConfig
from loraserve.demo.random_model import save_peft_adapter
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


# ---- the host cache under the scheduler's access pattern -----------------------------------------
@pytest.fixture(scope="module")
def trace_setup(
    tiny_model: Any, hf_model: Any, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, list[str]]:
    """The tiny Llama and 12 rank-8 PEFT adapters on it."""
    path = tiny_model("llama")
    root = tmp_path_factory.mktemp("trace-adapters")
    base = hf_model(path)
    adapters = [str(root / f"a{i:02d}") for i in range(NUM_ADAPTERS)]
    for i, folder in enumerate(adapters):
        lora = dict(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
        save_peft_adapter(base, folder, seed=300 + i, base_name=path, **lora)
    return path, adapters


def test_the_lru_simulation_misses_every_access_of_a_cycle_longer_than_the_cache() -> None:
    cycle = list(range(NUM_ADAPTERS)) * 5  # the order that defeats LRU
    assert lru_reads(cycle, HOST_ENTRIES) == len(cycle) and lru_reads(cycle, NUM_ADAPTERS) == NUM_ADAPTERS


@pytest.mark.parametrize("in_flight", [8, 32])
def test_a_random_trace_reads_from_disk_no_more_than_lru(
    trace_setup: tuple[str, list[str]], in_flight: int
) -> None:
    """12 adapters drawn at random over max_cpu_loras=8 (issue 22: 2,700 reads and 15 counted host
    hits in 10,479 requests): the engine reads from disk at most as often as an ideal LRU over the
    same arrivals, counts the requests that found their adapter in memory about as often as LRU hits,
    and never evicts an adapter a queued request needs while the queue needs no more than it holds."""
    # With the prefetch thread on (the default): a request queued since the last step marks its
    # adapter needed at once, so a prefetch between steps does not evict it.
    model, paths = trace_setup
    trace = uniform_trace(240, seed=1)
    counts = run_trace(trace_engine(model, max_loras=2), adapter_requests(paths), trace, in_flight)
    assert counts.disk_reads <= counts.lru_reads, counts
    assert counts.disk_reads <= counts.requests - counts.host_hits, counts  # a hit never needs a read
    assert counts.host_hits >= 0.85 * (counts.requests - counts.lru_reads), counts
    if in_flight <= HOST_ENTRIES:  # 8 requests need at most 8 adapters: all of them fit
        assert counts.needed_evictions == 0, counts
