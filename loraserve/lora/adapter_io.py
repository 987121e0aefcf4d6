"""The thread pool adapter file work runs on: reads and validation ahead of a request (prefetch,
in-place reloads), content digests, and the resolvers' file system and Hub look-ups.

It is its own pool, not asyncio's default executor, so that nothing else a server runs on worker
threads (grammar compiles, which have processes of their own; tokenizing, which has its own pool) can
make an adapter's first request wait for a thread, nor adapter work starve them. Threads are daemons:
a shutdown never waits for a read still in progress.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable
from concurrent.futures import Future
from queue import SimpleQueue
from typing import Any, TypeVar

T = TypeVar("T")

# Adapter work is mostly disk and network wait: more threads than cores, still a bound.
NUM_THREADS = 8

_Task = tuple[Callable[[], Any], Future]


class _DaemonPool:
    """A fixed set of daemon threads taking jobs in arrival order (concurrent.futures' pool joins
    its threads at interpreter exit, which a stuck download would hold up)."""

    def __init__(self, num_threads: int) -> None:
        self._jobs: SimpleQueue[_Task] = SimpleQueue()
        self._lock = threading.Lock()
        self._threads: list[threading.Thread] = []
        self._num_threads = num_threads

    def submit(self, fn: Callable[[], T]) -> Future[T]:
        future: Future[T] = Future()
        self._jobs.put((fn, future))
        with self._lock:
            if len(self._threads) < self._num_threads:
                thread = threading.Thread(
                    target=self._work, name=f"loraserve-adapter-io-{len(self._threads)}", daemon=True
                )
                self._threads.append(thread)
                thread.start()
        return future

    def _work(self) -> None:
        while True:
            fn, future = self._jobs.get()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(fn())
            except BaseException as exc:
                future.set_exception(exc)


_POOL = _DaemonPool(NUM_THREADS)


async def run_adapter_io(fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """`fn(*args, **kwargs)` on the adapter pool, awaited from the event loop."""
    return await asyncio.wrap_future(_POOL.submit(lambda: fn(*args, **kwargs)))
