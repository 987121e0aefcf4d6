"""`Prefetcher`: one background thread that brings back the adapters the waiting queue names.

The engine thread says, at each step, which adapters queued requests will need soonest and that
are not ready (`want`, soonest first; each call replaces the previous list, so the thread always
works on the queue as it is now). The thread runs `work(lora_id)` for them one at a time (bounded:
one read at a time, beside the step, never in it), so a request's adapter is usually back in host
memory and in a free slot before its turn. A failure is counted and dropped (not retried while the
adapter stays wanted): the step's own load path reads it again and reports its error to its requests. `work` is held weakly (it is
its owner's method, and the thread outlives no owner: `close` ends it).
"""

from __future__ import annotations

import logging
import threading
import types
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class PrefetchCounters:
    """Monotonic counters for metrics."""

    num_prefetches: int = 0  # adapters the thread read back (or placed in a free slot) ahead of their turn
    num_prefetch_failures: int = 0


class Prefetcher:
    def __init__(self, work: Callable[[int], bool]) -> None:
        """`work(lora_id)` brings one adapter back; True if it did anything (False: nothing to do)."""
        self._work = weakref.WeakMethod(work) if isinstance(work, types.MethodType) else (lambda: work)
        self.counters = PrefetchCounters()
        self._cond = threading.Condition()
        self._wanted: list[int] = []
        self._failed: set[int] = set()  # not tried again while they stay wanted
        self._busy = False
        self._closed = False
        self._thread: threading.Thread | None = None

    def want(self, lora_ids: Sequence[int]) -> None:
        """The adapters to bring back now, soonest needed first (replaces the previous list). One that
        failed is not tried again until a list leaves it out (its requests' own load answers them)."""
        with self._cond:
            if self._closed:
                return
            self._failed.intersection_update(lora_ids)
            self._wanted = [i for i in dict.fromkeys(lora_ids) if i not in self._failed]
            if self._wanted and self._thread is None:
                self._thread = threading.Thread(target=self._run, name="lora-prefetch", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def wait_idle(self, timeout: float | None = None) -> bool:
        """Wait until nothing is wanted or being read; False if `timeout` passed first."""
        with self._cond:
            return self._cond.wait_for(lambda: not self._wanted and not self._busy, timeout)

    def close(self) -> None:
        """Stop the thread once its current read ends; later `want` calls do nothing."""
        with self._cond:
            self._closed = True
            self._wanted = []
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._wanted or self._closed)
                if self._closed:
                    return
                lora_id = self._wanted.pop(0)
                self._busy = True
            try:
                self._one(lora_id)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _one(self, lora_id: int) -> None:
        work = self._work()
        if work is None:  # the owner is gone
            self.close()
            return
        try:
            if work(lora_id):
                self.counters.num_prefetches += 1
        except Exception as exc:  # noqa: BLE001 - a prefetch fails nothing; the step's load reports it
            self.counters.num_prefetch_failures += 1
            with self._cond:
                self._failed.add(lora_id)
            logger.debug(
                "Prefetching LoRA id %d failed (its requests' own load reports it): %s", lora_id, exc
            )
