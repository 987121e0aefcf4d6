"""`LRUCache`: a bounded map that evicts by recency ("lru") or by expected miss cost ("cost"),
whose evictions run a hook.

Both adapter tiers use it: the host cache (adapter id -> loaded adapter) and the slot table
(adapter id -> compute slot). Policy "cost" is GreedyDual-Size-Frequency with every entry one unit
of capacity: an entry's priority is `clock at its last touch + touches x cost` (touches: `put` and
`get` since it came in; cost: `cost_of(key, value)` asked when a victim is chosen, what bringing it
back would take now, e.g. expected reload seconds); the lowest priority goes first (ties: the least
recently used), and each eviction raises the clock to the victim's priority, so entries not touched
for a while age out whatever they cost. With equal costs and single touches the order is LRU's. Entries a caller must keep (pinned, or used by the running step) are
passed as `keep` and never chosen for eviction. Entries a caller would rather keep (adapters that
queued requests still need) are passed as `needed`, soonest needed first: they go only when nothing
else can, the one needed last first (the entry used furthest in the future is the best victim; plain
LRU would evict the adapter whose requests wait the longest, which is the next one they need). Not
thread-safe: the owner holds its lock.
"""

from __future__ import annotations

import itertools
import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable, Iterator, Sequence
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")

EVICTION_POLICIES = ("lru", "cost")


class CacheFullError(ValueError):
    """Every entry of a full cache is kept: nothing can make room."""


class LRUCache(Generic[K, V]):
    """At most `capacity` entries; `on_evict(key, value)` runs for each entry evicted to make room
    (not for entries the owner removes with `pop`)."""

    def __init__(
        self,
        capacity: int,
        on_evict: Callable[[K, V], None] | None = None,
        policy: str = "lru",
        cost_of: Callable[[K, V], float] | None = None,
    ) -> None:
        if capacity < 1:
            raise ValueError(f"an LRU cache needs a capacity >= 1, got {capacity}")
        if policy not in EVICTION_POLICIES:
            raise ValueError(f"unknown eviction policy {policy!r}; choose one of {EVICTION_POLICIES}")
        self.capacity = capacity
        self.policy = policy
        self._cost_of = cost_of  # None: every entry costs 1
        self._clock = 0.0  # "cost": the priority of the last victim (GreedyDual's L)
        self._touches: dict[K, int] = {}
        self._base: dict[K, float] = {}  # the clock at each entry's last touch
        # The hook is usually the owner's own method: held weakly, so owner -> cache -> owner is no
        # reference cycle, and a dropped owner (with every adapter it holds) is freed at once.
        self._on_evict = _weak_callable(on_evict)
        self._entries: OrderedDict[K, V] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    @property
    def is_full(self) -> bool:
        return len(self._entries) >= self.capacity

    def keys(self) -> list[K]:
        """Least recently used first."""
        return list(self._entries)

    def items(self) -> list[tuple[K, V]]:
        """Least recently used first."""
        return list(self._entries.items())

    def peek(self, key: K) -> V | None:
        """The value, leaving the order alone."""
        return self._entries.get(key)

    def get(self, key: K) -> V | None:
        """The value, now the most recently used (and, under "cost", touched once more)."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        self._touch(key)
        return self._entries[key]

    def priority(self, key: K) -> float | None:
        """The entry's priority under "cost" (lowest is evicted first); None if absent."""
        if key not in self._entries:
            return None
        cost = 1.0 if self._cost_of is None else max(0.0, self._cost_of(key, self._entries[key]))
        return self._base[key] + self._touches[key] * cost

    def _touch(self, key: K) -> None:
        self._touches[key] = self._touches.get(key, 0) + 1
        self._base[key] = self._clock

    def victim(self, keep: Container[K], needed: Sequence[K] = ()) -> K | None:
        """What the next eviction would take: the first key in policy order (least recently used,
        or lowest priority) in neither `keep` nor `needed`, else the last key of `needed` that is
        cached and not kept."""
        return next(self._victims(keep, needed), None)

    def _victims(self, keep: Container[K], needed: Sequence[K]) -> Iterator[K]:
        """Keys in the order evictions take them (kept keys never)."""
        later = set(needed)
        free = [key for key in self._entries if key not in keep and key not in later]
        if self.policy == "cost":  # a stable sort: equal priorities keep the LRU order
            priorities = {key: self.priority(key) or 0.0 for key in free}
            free.sort(key=priorities.__getitem__)
        yield from free
        yield from (
            key for key in reversed(dict.fromkeys(needed)) if key in self._entries and key not in keep
        )

    def evict(self, key: K) -> V:
        """Remove `key` as an eviction: the hook runs."""
        if self.policy == "cost":
            self._clock = max(self._clock, self.priority(key) or 0.0)
        value = self._entries.pop(key)
        self._forget(key)
        if self._on_evict is not None:
            hook = self._on_evict()
            if hook is None:  # a hook that died before its cache would skip evictions silently
                raise RuntimeError("the LRU cache's eviction hook was garbage-collected before the cache")
            hook(key, value)
        return value

    def make_room(self, keep: Container[K], needed: Sequence[K] = ()) -> None:
        """Evict entries (in `victim` order) until one more fits; CacheFullError when only kept
        entries are left (nothing is evicted then)."""
        if not self.is_full:
            return
        excess = len(self._entries) - self.capacity + 1
        victims = list(itertools.islice(self._victims(keep, needed), excess))
        if len(victims) < excess:
            raise CacheFullError(f"all {len(self._entries)} entries are kept")
        for key in victims:
            self.evict(key)

    def put(self, key: K, value: V, keep: Container[K] = (), needed: Sequence[K] = ()) -> None:
        """Insert or replace as the most recently used (touched once more), first making room (see
        `make_room`)."""
        if key not in self._entries:
            self.make_room(keep, needed)
        self._entries[key] = value
        self._entries.move_to_end(key)
        self._touch(key)

    def pop(self, key: K) -> V | None:
        """Remove `key` without running the hook; None when absent."""
        self._forget(key)
        return self._entries.pop(key, None)

    def _forget(self, key: K) -> None:
        self._touches.pop(key, None)
        self._base.pop(key, None)


def _weak_callable(
    fn: Callable[[K, V], None] | None,
) -> Callable[[], Callable[[K, V], None] | None] | None:
    """None, or a getter for `fn`: a Python bound method through a weak reference, anything else as is."""
    if fn is None:
        return None
    if isinstance(fn, types.MethodType):
        return weakref.WeakMethod(fn)
    return lambda: fn
