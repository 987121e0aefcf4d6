"""`LRUCache`: recency with kept and needed entries, the order the host cache evicts in."""

from __future__ import annotations

import pytest

from loraserve.lora.lru import CacheFullError, LRUCache


def test_lru_evicts_least_recent_not_kept_and_runs_the_hook() -> None:
    evicted: list[tuple[str, int]] = []
    cache: LRUCache[str, int] = LRUCache(2, lambda k, v: evicted.append((k, v)))
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1 and cache.keys() == ["b", "a"]  # get refreshes, peek does not
    cache.put("c", 3, keep={"b"})  # b is least recent but kept: a goes
    assert evicted == [("a", 1)] and cache.keys() == ["b", "c"]
    with pytest.raises(CacheFullError):
        cache.put("d", 4, keep={"b", "c"})
    assert cache.keys() == ["b", "c"] and cache.pop("b") == 2 and evicted == [("a", 1)]  # pop: no hook
    assert cache.victim(keep={"c"}) is None and cache.peek("c") == 3 and "c" in cache and len(cache) == 1


def test_lru_evicts_needed_entries_last_the_one_needed_last_first() -> None:
    evicted: list[str] = []
    cache: LRUCache[str, int] = LRUCache(3, lambda k, v: evicted.append(k))
    for i, key in enumerate("abc"):
        cache.put(key, i)
    cache.put("d", 3, needed=["a"])  # a is least recent, but a queued request needs it: b goes
    assert evicted == ["b"] and cache.keys() == ["a", "c", "d"]
    # Every entry is needed and c is kept: of the others, a is needed last (plain LRU would take it too).
    cache.put("e", 4, keep={"c"}, needed=["d", "a", "c"])
    assert evicted == ["b", "a"] and cache.keys() == ["c", "d", "e"]
    assert cache.victim(keep={"e"}, needed=["d", "c"]) == "c"  # needed last, though more recent than d
    assert cache.victim(keep={"c"}, needed=["c", "d", "c"]) == "e"  # repeats change nothing
    with pytest.raises(CacheFullError):
        cache.put("f", 5, keep={"c", "d", "e"}, needed=["c"])
    assert evicted == ["b", "a"] and len(cache) == 3
