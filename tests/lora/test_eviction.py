"""Cost-aware eviction: the "cost" policy of `LRUCache` (GreedyDual-Size-Frequency), the reload-cost
estimate it weighs adapters by (`ReloadCosts`), and the option that picks the policy."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest
import torch
from support.stand_in_model import StandInLlama, write_stand_in_adapter

from loraserve.config import LoRAConfig
from loraserve.lora.eviction import DEFAULT_BANDWIDTH, FIXED_SECONDS, ReloadCosts, source_of
from loraserve.lora.lru import CacheFullError, LRUCache
from loraserve.lora.manager import LoRAManager
from loraserve.lora.request import LoRARequest


def _cost_cache(capacity: int, costs: dict[str, float]) -> tuple[LRUCache[str, int], list[str]]:
    evicted: list[str] = []
    cache: LRUCache[str, int] = LRUCache(
        capacity, lambda key, _: evicted.append(key), "cost", lambda key, _: costs[key]
    )
    return cache, evicted


def test_equal_costs_evict_in_lru_order() -> None:
    """Each key touched once, in a random order with repeats only after eviction: the same victims as LRU."""
    rng = random.Random(0)
    keys = [f"k{rng.randrange(30)}" for _ in range(400)]
    lru_evicted: list[str] = []
    lru: LRUCache[str, int] = LRUCache(5, lambda key, _: lru_evicted.append(key))
    cost, cost_evicted = _cost_cache(5, {key: 2.5 for key in keys})
    for i, key in enumerate(keys):
        for cache in (lru, cost):
            if key not in cache:  # a miss, as a cache sees it: put once, no other touch
                cache.put(key, i)
        assert cost.keys() == lru.keys()
    assert cost_evicted == lru_evicted and len(lru_evicted) > 100


def test_a_costly_adapter_survives_a_cheap_one() -> None:
    cache, evicted = _cost_cache(2, {"costly": 10.0, "cheap": 1.0, "new": 1.0})
    cache.put("costly", 1)  # the least recently used: LRU would evict it
    cache.put("cheap", 2)
    assert cache.victim(keep=()) == "cheap"
    cache.put("new", 3)
    assert evicted == ["cheap"] and cache.keys() == ["costly", "new"]


def test_the_cost_is_asked_when_a_victim_is_chosen() -> None:
    costs = {"a": 1.0, "b": 5.0}
    cache, _ = _cost_cache(2, costs)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.victim(keep=()) == "a"
    costs["a"] = 50.0  # its source turned out slow: a is now the one to keep
    assert cache.victim(keep=()) == "b"


def test_frequency_counts_and_the_clock_ages_the_costly_out() -> None:
    """Touches multiply the cost; each eviction raises the clock, so an entry nobody touches goes in
    the end whatever it costs (a bounded number of evictions: cost / cheap cost)."""
    costs = {"popular": 1.0, "costly": 4.0}
    cache, evicted = _cost_cache(3, costs)
    cache.put("popular", 0)
    for _ in range(9):
        cache.get("popular")  # 10 touches: priority 10
    cache.put("costly", 0)  # priority 4
    for i in range(10):
        costs[f"n{i}"] = 1.0
        cache.put(f"n{i}", i)
    assert evicted.index("costly") <= 5 and "popular" not in evicted
    assert cache.priority("popular") == 10.0 and cache.priority("gone") is None


def test_needed_adapters_are_never_evicted_for_unneeded_ones() -> None:
    cache, evicted = _cost_cache(2, {"needed": 0.1, "costly": 100.0, "new": 1.0})
    cache.put("needed", 1)
    cache.put("costly", 2)
    cache.put("new", 3, needed=["needed"])  # cheap and oldest, but queued requests use it
    assert evicted == ["costly"]
    cache.put("costly", 4, needed=["new", "needed"])  # all needed: the one needed last goes
    assert evicted == ["costly", "needed"]


def test_kept_adapters_stay_and_a_full_kept_cache_refuses() -> None:
    cache, evicted = _cost_cache(2, {"pinned": 0.0, "costly": 100.0, "new": 1.0, "more": 1.0})
    cache.put("pinned", 1)
    cache.put("costly", 2)
    cache.put("new", 3, keep={"pinned"})
    assert evicted == ["costly"]
    with pytest.raises(CacheFullError):
        cache.put("more", 4, keep={"pinned", "new"})
    assert cache.keys() == ["pinned", "new"]


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        LRUCache(2, policy="mru")


# ---- the reload-cost estimate ---------------------------------------------------------------------
def test_reload_costs_start_from_the_default_bandwidth_and_follow_measurements() -> None:
    costs = ReloadCosts()
    assert costs.expected_seconds("/data/a", 10**8) == pytest.approx(
        FIXED_SECONDS + 10**8 / DEFAULT_BANDWIDTH["local"]
    )
    costs.observe("local", 10**8, FIXED_SECONDS + 2.0)  # the first measurement replaces the default
    assert costs.rate("local") == pytest.approx(2e-8)
    costs.observe("local", 10**8, FIXED_SECONDS + 12.0)  # later ones move it a fifth of the way
    assert costs.rate("local") == pytest.approx(0.8 * 2e-8 + 0.2 * 12e-8)
    assert costs.rate("s3") == pytest.approx(1 / DEFAULT_BANDWIDTH["s3"])  # other sources unchanged
    costs.observe("local", 0, 5.0)  # nothing to divide by: ignored
    assert costs.num_measured["local"] == 2


def test_source_of_names_s3_copies_and_mixes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LORASERVE_LORA_RESOLVER_S3_CACHE_DIR", str(tmp_path / "s3"))
    assert source_of(os.path.join(tmp_path, "s3", "abc", "v1")) == "s3"
    assert source_of(str(tmp_path / "s3-other" / "a")) == "local"
    assert source_of("mix://french=0.7,sql=0.3") == "mix"


def test_the_policy_comes_from_the_option_or_its_env_twin(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("LORASERVE_LORA_EVICTION_POLICY", "lru")
    assert LoRAConfig().eviction_policy == "lru"
    assert LoRAConfig(lora_eviction_policy="cost").eviction_policy == "cost"  # the option wins
    monkeypatch.setenv("LORASERVE_LORA_EVICTION_POLICY", "fifo")
    with pytest.raises(ValueError, match="must be 'lru' or 'cost', got 'fifo'"):
        LoRAConfig().eviction_policy  # noqa: B018
    monkeypatch.delenv("LORASERVE_LORA_EVICTION_POLICY")
    config = LoRAConfig(max_loras=1, max_cpu_loras=2, max_lora_rank=8)
    assert config.eviction_policy == "cost"  # the default
    manager = LoRAManager(StandInLlama(), config, torch.float32, "cpu")
    for i in (1, 2, 3):
        manager.load(LoRARequest(f"ad{i}", i, str(write_stand_in_adapter(tmp_path / f"ad{i}", i))))
    assert manager.stats()["lora_num_host_evictions"] == 1
