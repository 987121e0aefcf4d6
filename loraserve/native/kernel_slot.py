"""`KernelSlot`: how every kernel family holds its loaded build. One per family (its module's
`_kernel`, which its functions read at each call, so a test may put another slot there), the build
made on the first ask, under a lock only until then (the hot paths ask on every
call), None where the family's switch is off or the kernel cannot be built; tests swap in another
build (another CPU class's code paths, or None for the torch twin) with `use`.

A family binds its C entry points in the `build` function it gives the slot (argument types, checks of
the C side's layout), so what the slot holds is ready to call."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class KernelSlot(Generic[T]):
    """One kernel family's build for this process. `enabled` is read on every `get` (benchmarks and
    tests flip the LORASERVE_CPU_* switches between calls); `build` runs once, on the first enabled ask."""

    def __init__(self, build: Callable[[], T | None], enabled: Callable[[], bool] = lambda: True) -> None:
        self._build = build
        self._enabled = enabled
        self._lock = threading.Lock()
        self._value: T | None = None
        self._loaded = False

    def get(self) -> T | None:
        """The build (made once), or None: switched off, or no compiler."""
        if not self._enabled():
            return None
        if not self._loaded:
            with self._lock:
                if not self._loaded:
                    self._value = self._build()
                    self._loaded = True
        return self._value

    def use(self, value: T | None) -> None:
        """Replace the build (tests: another code path's build, or None for the torch twin)."""
        with self._lock:
            self._value, self._loaded = value, True

    @classmethod
    def holding(cls, value: T | None, enabled: Callable[[], bool] = lambda: True) -> KernelSlot[T]:
        """A slot already holding `value` (tests put one in a family's `_kernel`)."""
        slot: KernelSlot[T] = cls(lambda: value, enabled)
        slot.use(value)
        return slot

    def current(self) -> T | None:
        """The build already made, without building (None before the first `get`)."""
        return self._value
