"""FairTokenizerPool: a few worker threads for tokenizing and chat templates, shared in turn by client.

Tokenizing takes CPU time that grows with the text, so it never runs on the event loop. Hugging Face
fast tokenizers release the GIL while they encode, so more than one worker serves more than one
prompt at a time (the tokenizer is only read: every caller encodes without truncation or padding,
so no call reconfigures it under another). Work waits in one queue per client
(`ClientIdentity.fairness_key`; no key: a queue of its own) and a free worker takes the next job of
the client served least recently, so one client's queue of huge prompts never sits in front of
another client's short one.
"""

from __future__ import annotations

import asyncio
import functools
import os
from collections import Counter, deque
from collections.abc import Callable, Hashable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")
DEFAULT_WORKERS = 4  # more would mostly contend for the same cores the engine steps on


@dataclass(slots=True)
class _Job:
    fn: Callable[[], Any]
    future: asyncio.Future[Any] = field(repr=False)


class FairTokenizerPool:
    def __init__(self, num_workers: int | None = None) -> None:
        self.num_workers = num_workers or max(1, min(DEFAULT_WORKERS, os.cpu_count() or 1))
        self._executor = ThreadPoolExecutor(self.num_workers, thread_name_prefix="loraserve-tokenizer")
        self._queues: dict[Hashable, deque[_Job]] = {}
        self._running: Counter[Hashable] = Counter()
        self._served_at: dict[Hashable, int] = {}  # clients with work queued or running: last turn
        self._turn = 0
        self._busy = 0

    @property
    def num_queued(self) -> int:
        return sum(len(queue) for queue in self._queues.values())

    async def run(self, client: Hashable | None, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        """`fn(*args, **kwargs)` on a worker, in `client`'s turn."""
        key: Hashable = client if client is not None else object()
        job = _Job(functools.partial(fn, *args, **kwargs), asyncio.get_running_loop().create_future())
        self._queues.setdefault(key, deque()).append(job)
        self._dispatch()
        return await job.future  # a cancelled caller's job is skipped unless it already started

    def _dispatch(self) -> None:
        while self._busy < self.num_workers and self._queues:
            # The client served least recently (never: first; ties: the earliest queue).
            key = min(self._queues, key=lambda k: self._served_at.get(k, -1))
            queue = self._queues[key]
            job = queue.popleft()
            if not queue:
                del self._queues[key]
            if job.future.done():  # the caller left while it waited
                self._forget(key)
                continue
            self._busy += 1
            self._turn += 1
            self._served_at[key] = self._turn
            self._running[key] += 1
            work = job.future.get_loop().run_in_executor(self._executor, job.fn)
            work.add_done_callback(functools.partial(self._finished, key, job))

    def _finished(self, key: Hashable, job: _Job, work: asyncio.Future[Any]) -> None:
        self._busy -= 1
        self._running[key] -= 1
        self._forget(key)
        if not job.future.done():
            if work.cancelled():
                job.future.cancel()
            elif work.exception() is not None:
                job.future.set_exception(work.exception())  # type: ignore[arg-type]
            else:
                job.future.set_result(work.result())
        self._dispatch()

    def _forget(self, key: Hashable) -> None:
        """Drop a client's turn record once it has nothing queued or running (peers come and go)."""
        if key not in self._queues and self._running[key] <= 0:
            self._running.pop(key, None)
            self._served_at.pop(key, None)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
