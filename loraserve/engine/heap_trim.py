"""Giving freed heap memory back to the OS, so a long-running server's RSS tracks what it uses.

A serving process allocates and frees activations of ever-changing shapes (each step's batch differs),
adapter files as they are read and evicted, and per-request buffers. glibc keeps much of what is freed
inside its arenas, so RSS ratchets up for minutes under varied traffic although nothing leaks.
`malloc_trim(0)` returns the free pages (the arena tops and, since glibc 2.8, whole free pages inside
them). It costs milliseconds, so the engine thread calls `HeapTrimmer.maybe_trim()` between steps and
it trims at most once per `interval_s`. Where there is no glibc (musl, macOS) it does nothing.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import time
from collections.abc import Callable

logger = logging.getLogger(__name__)
TRIM_INTERVAL_S = 10.0


def _find_malloc_trim() -> Callable[[int], int] | None:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    try:
        return ctypes.CDLL(name).malloc_trim  # type: ignore[no-any-return]
    except (OSError, AttributeError):
        return None


class HeapTrimmer:
    def __init__(self, interval_s: float = TRIM_INTERVAL_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.clock = clock
        self._trim = _find_malloc_trim()
        self._last = clock()
        self.num_trims = 0

    @property
    def is_available(self) -> bool:
        return self._trim is not None

    def maybe_trim(self) -> bool:
        """Trim if `interval_s` has passed since the last trim; True if it trimmed."""
        now = self.clock()
        if self._trim is None or now - self._last < self.interval_s:
            return False
        self._last = now
        self._trim(0)
        self.num_trims += 1
        return True
