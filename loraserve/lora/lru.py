"""`LRUCache`: a bounded map kept in least-recently-used order, whose evictions run a hook.

Both adapter tiers use it: the host cache (adapter id -> loaded adapter) and the slot table
(adapter id -> compute slot). Entries a caller must keep (pinned, or used by the running step) are
passed as `keep` and never chosen for eviction. Not thread-safe: the owner holds its lock.
"""

from __future__ import annotations

import types
import weakref
from collections import OrderedDict
from collections.abc import Callable, Container, Hashable
from typing import Generic, TypeVar

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class CacheFullError(ValueError):
    """Every entry of a full cache is kept: nothing can make room."""


class LRUCache(Generic[K, V]):
    """At most `capacity` entries; `on_evict(key, value)` runs for each entry evicted to make room
    (not for entries the owner removes with `pop`)."""

    def __init__(self, capacity: int, on_evict: Callable[[K, V], None] | None = None) -> None:
        if capacity < 1:
            raise ValueError(f"an LRU cache needs a capacity >= 1, got {capacity}")
        self.capacity = capacity
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
        """The value, now the most recently used."""
        if key not in self._entries:
            return None
        self._entries.move_to_end(key)
        return self._entries[key]

    def victim(self, keep: Container[K]) -> K | None:
        """The least recently used key not in `keep` (what the next eviction would take)."""
        return next((key for key in self._entries if key not in keep), None)

    def evict(self, key: K) -> V:
        """Remove `key` as an eviction: the hook runs."""
        value = self._entries.pop(key)
        if self._on_evict is not None:
            hook = self._on_evict()
            if hook is None:  # a hook that died before its cache would skip evictions silently
                raise RuntimeError("the LRU cache's eviction hook was garbage-collected before the cache")
            hook(key, value)
        return value

    def make_room(self, keep: Container[K]) -> None:
        """Evict least recently used entries not in `keep` until one more fits; CacheFullError when
        only kept entries are left (nothing is evicted then)."""
        if not self.is_full:
            return
        victims = [key for key in self._entries if key not in keep][: len(self._entries) - self.capacity + 1]
        if len(victims) < len(self._entries) - self.capacity + 1:
            raise CacheFullError(f"all {len(self._entries)} entries are kept")
        for key in victims:
            self.evict(key)

    def put(self, key: K, value: V, keep: Container[K] = ()) -> None:
        """Insert or replace as the most recently used, first making room (see `make_room`)."""
        if key not in self._entries:
            self.make_room(keep)
        self._entries[key] = value
        self._entries.move_to_end(key)

    def pop(self, key: K) -> V | None:
        """Remove `key` without running the hook; None when absent."""
        return self._entries.pop(key, None)


def _weak_callable(
    fn: Callable[[K, V], None] | None,
) -> Callable[[], Callable[[K, V], None] | None] | None:
    """None, or a getter for `fn`: a Python bound method through a weak reference, anything else as is."""
    if fn is None:
        return None
    if isinstance(fn, types.MethodType):
        return weakref.WeakMethod(fn)
    return lambda: fn
