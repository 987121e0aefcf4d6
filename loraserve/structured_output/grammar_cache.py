"""A bounded LRU of compiled grammars keyed by `GrammarKey`, with hit and miss counts.

Compiling a real schema costs tens of milliseconds at a 49k vocabulary; the same schema sent again
(the common case: one schema per application) is a dictionary lookup. Entries are immutable
compiled grammars that any number of matchers share, so eviction never touches a running sequence.
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from loraserve.structured_output.params import GrammarKey

T = TypeVar("T")
DEFAULT_CAPACITY = 512


@dataclass(slots=True)
class GrammarCache(Generic[T]):
    capacity: int = DEFAULT_CAPACITY
    hits: int = 0
    misses: int = 0
    _entries: OrderedDict[GrammarKey, T] = field(default_factory=OrderedDict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def get_or_compile(self, key: GrammarKey, compile_fn: Callable[[GrammarKey], T]) -> T:
        """The cached grammar for `key`, else `compile_fn(key)` cached (a failure caches nothing)."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                return found
            self.misses += 1
        compiled = compile_fn(key)  # outside the lock: another schema need not wait for this one
        with self._lock:
            self._store(key, compiled)
        return compiled

    def get(self, key: GrammarKey) -> T | None:
        """The cached grammar for `key` (counted as a hit), or None (not counted: the caller compiles
        it elsewhere and `put`s it, counting the miss then)."""
        with self._lock:
            found = self._entries.get(key)
            if found is not None:
                self._entries.move_to_end(key)
                self.hits += 1
            return found

    def put(self, key: GrammarKey, compiled: T) -> None:
        """Cache a grammar compiled elsewhere (a compile worker): one miss."""
        with self._lock:
            self.misses += 1
            self._store(key, compiled)

    def _store(self, key: GrammarKey, compiled: T) -> None:
        self._entries[key] = compiled
        self._entries.move_to_end(key)
        while len(self._entries) > self.capacity:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: GrammarKey) -> bool:
        return key in self._entries
