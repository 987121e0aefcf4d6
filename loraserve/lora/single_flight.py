"""`SingleFlight`: one lock per key while work on it is in flight, so that concurrent first requests
for one adapter wait for a single disk read instead of each reading it. Thread-safe."""

from __future__ import annotations

import threading
from collections.abc import Hashable, Iterator
from contextlib import contextmanager


class SingleFlight:
    """`with flights.hold(key):` runs one holder of `key` at a time; the lock goes once none waits."""

    def __init__(self) -> None:
        self._locks: dict[Hashable, tuple[threading.Lock, int]] = {}  # key -> (lock, holders + waiters)
        self._guard = threading.Lock()

    def __len__(self) -> int:
        """Keys in flight (held or waited for)."""
        with self._guard:
            return len(self._locks)

    def waiting(self, key: Hashable) -> int:
        """Threads holding or waiting for `key`."""
        with self._guard:
            return self._locks.get(key, (None, 0))[1]

    @contextmanager
    def hold(self, key: Hashable) -> Iterator[None]:
        with self._guard:
            lock, users = self._locks.get(key, (None, 0))
            lock = lock or threading.Lock()
            self._locks[key] = (lock, users + 1)
        try:
            with lock:
                yield
        finally:
            with self._guard:
                lock, users = self._locks[key]
                if users == 1:
                    del self._locks[key]
                else:
                    self._locks[key] = (lock, users - 1)
