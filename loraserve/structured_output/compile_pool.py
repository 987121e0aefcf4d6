"""GrammarCompilePool: the server's grammar compiles, on worker processes of their own, bounded in
time, shared fairly by clients, and stopped when nobody waits for them.

- Isolated: a compile runs in a `compile_worker` process (xgrammar cannot be interrupted inside a
  thread); the pool's threads only send work and read answers. Nothing else (adapter loads,
  tokenizing, the event loop's default executor) waits behind a compile, and a grammar already in the
  cache is never looked up here at all.
- Bounded: `timeout_s` from the moment a worker takes the job; past it the worker is killed (a fresh
  one is forked for the next job) and the request gets `GrammarCompileTimeoutError`, a 400 naming its
  field. `grammar_compile.check_budget` refuses what is over the size budget before it is queued.
- Fair: jobs queue per client (the API key, else the peer address) and workers take them round-robin
  by client; one client's jobs hold at most `client_share` of the workers at once (at least one), so
  another client's new grammar finds a worker free or waits for at most one compile. Identical
  constraints share one job (a request's prompts, or two clients sending one schema).
- Cancellable: `CompileTicket.cancel()` (the request's client went away, or its handler was
  cancelled) drops the job when no other ticket waits for it: out of the queue, or its worker killed.
- Shutdown kills the workers and fails the waiting tickets with `EngineShutdownError`; it waits for
  nothing (the pool's threads are daemons).
"""

from __future__ import annotations

import logging
import math
import multiprocessing
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable, Hashable
from concurrent.futures import Future
from dataclasses import dataclass, field
from multiprocessing import popen_forkserver, spawn
from multiprocessing.context import ForkServerProcess
from typing import Any

from loraserve.errors import EngineShutdownError
from loraserve.structured_output import compile_worker
from loraserve.structured_output.grammar_compile import GrammarCompileError
from loraserve.structured_output.params import GrammarKey

logger = logging.getLogger(__name__)

# A new worker imports nothing (the fork server has): it is ready in well under a second; the first
# one waits for the fork server itself to import xgrammar and torch.
WORKER_START_TIMEOUT_S = 120.0
_CONTEXT = multiprocessing.get_context("forkserver")
_CONTEXT.set_forkserver_preload([compile_worker.__name__])
_PREPARING = threading.Lock()


class _WorkerPopen(popen_forkserver.Popen):
    """The fork server's start, without the parent's `__main__` in what the child prepares from: a
    worker runs `compile_worker.serve` and nothing else (multiprocessing imports the main module in
    every child, so a script without a `__main__` guard ran again in each worker, server and all)."""

    def _launch(self, process_obj: Any) -> None:
        with _PREPARING:
            original = spawn.get_preparation_data

            def without_main(name: str) -> dict[str, Any]:
                data = original(name)
                data.pop("init_main_from_name", None)
                data.pop("init_main_from_path", None)
                return data

            spawn.get_preparation_data = without_main  # read by the base class's _launch, only there
            try:
                super()._launch(process_obj)  # type: ignore[misc]  # (typeshed omits it)
            finally:
                spawn.get_preparation_data = original


class _WorkerProcess(ForkServerProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _WorkerPopen:  # type: ignore[override]
        return _WorkerPopen(process_obj)


class GrammarCompileTimeoutError(GrammarCompileError):
    """A compile ran past the pool's timeout (HTTP 400): the constraint is too complex to serve."""


@dataclass(frozen=True, slots=True)
class CompileSettings:
    workers: int = 2
    timeout_s: float = 10.0
    client_share: float = 0.5  # of the workers one client's compiles may hold at once (at least one)

    @property
    def per_client(self) -> int:
        return max(1, math.floor(self.workers * self.client_share))


@dataclass(slots=True, eq=False)
class _Job:
    key: GrammarKey
    client: Hashable
    parameter: str | None
    tickets: set[CompileTicket] = field(default_factory=set)
    worker: _Worker | None = None
    cancelled: bool = False


class CompileTicket:
    """One request's wait for a compile: `future` completes with the compiled grammar (or its
    error); `cancel()` once the request no longer wants it."""

    def __init__(self, pool: GrammarCompilePool, job: _Job) -> None:
        self.pool = pool
        self.job = job
        self.future: Future[Any] = Future()

    def cancel(self) -> None:
        self.pool._withdraw(self)


STAT_NAMES = (
    "grammar_compiles_queued",
    "grammar_compiles_running",
    "grammar_compiles",
    "grammar_compile_timeouts",
    "grammar_compiles_cancelled",
    "grammar_compile_workers_started",
)


class GrammarCompilePool:
    """`submit(key, client, parameter) -> CompileTicket`. `tokenizer_info()` gives the vocabulary
    (xgrammar's JSON) a worker starts from; `load(key, serialised)` turns a worker's answer into the
    compiled grammar (and caches it), on the pool's thread."""

    def __init__(
        self,
        tokenizer_info: Callable[[], str],
        load: Callable[[GrammarKey, str], Any],
        settings: CompileSettings,
    ) -> None:
        self.tokenizer_info = tokenizer_info
        self.load = load
        self.settings = settings
        self._cond = threading.Condition()
        self._queues: OrderedDict[Hashable, deque[_Job]] = OrderedDict()  # first: the next turn
        self._running: Counter[Hashable] = Counter()
        self._jobs: dict[GrammarKey, _Job] = {}  # queued or running, by constraint
        self._workers = [_Worker(self, i) for i in range(settings.workers)]
        self._closed = False
        self.num_compiled = 0
        self.num_timeouts = 0
        self.num_cancelled = 0
        self.num_workers_started = 0

    def submit(self, key: GrammarKey, client: Hashable, parameter: str | None = None) -> CompileTicket:
        with self._cond:
            if self._closed:
                raise EngineShutdownError("The server is shutting down and accepts no new requests.")
            job = self._jobs.get(key)
            if job is None:
                job = self._jobs[key] = _Job(key, client, parameter)
                self._queues.setdefault(client, deque()).append(job)
                for worker in self._workers:
                    worker.start()
                self._cond.notify_all()
            ticket = CompileTicket(self, job)
            job.tickets.add(ticket)
            return ticket

    @staticmethod
    def empty_stats() -> dict[str, int]:
        """`stats()` of a pool that has done nothing."""
        return dict.fromkeys(STAT_NAMES, 0)

    def stats(self) -> dict[str, int]:
        with self._cond:
            queued = sum(len(queue) for queue in self._queues.values())
            return {
                "grammar_compiles_queued": queued,
                "grammar_compiles_running": sum(self._running.values()),
                "grammar_compiles": self.num_compiled,
                "grammar_compile_timeouts": self.num_timeouts,
                "grammar_compiles_cancelled": self.num_cancelled,
                "grammar_compile_workers_started": self.num_workers_started,
            }

    def shutdown(self) -> None:
        """Kill the workers and fail every waiting ticket; returns at once."""
        with self._cond:
            self._closed = True
            jobs = list(self._jobs.values())
            self._jobs.clear()
            self._queues.clear()
            self._cond.notify_all()
        for worker in self._workers:
            worker.kill()
        error = EngineShutdownError("The server is shutting down; the request did not finish.")
        for job in jobs:
            for ticket in list(job.tickets):
                _settle(ticket.future, None, error)

    # ---- the pool's threads -------------------------------------------------------------------
    def _take(self, worker: _Worker) -> _Job | None:
        """The next job in turn whose client is within its share of the workers; None at shutdown."""
        with self._cond:
            while not self._closed:
                for client, queue in self._queues.items():
                    if self._running[client] >= self.settings.per_client:
                        continue
                    job = queue.popleft()
                    if queue:
                        self._queues.move_to_end(client)  # its next job waits for the others' turns
                    else:
                        del self._queues[client]
                    self._running[client] += 1
                    job.worker = worker
                    return job
                self._cond.wait()
            return None

    def _done(self, job: _Job, result: Any, error: BaseException | None) -> None:
        with self._cond:
            self._running[job.client] -= 1
            if self._running[job.client] <= 0:
                del self._running[job.client]
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            job.worker = None
            tickets = list(job.tickets)
            if isinstance(error, GrammarCompileTimeoutError):
                self.num_timeouts += 1
            elif error is None:
                self.num_compiled += 1
            self._cond.notify_all()
        for ticket in tickets:
            _settle(ticket.future, result, error)

    def _withdraw(self, ticket: CompileTicket) -> None:
        ticket.future.cancel()
        if ticket.future.done() and not ticket.future.cancelled():
            return  # it has its answer already: nothing to withdraw
        job = ticket.job
        with self._cond:
            job.tickets.discard(ticket)
            if job.tickets or job.cancelled:
                return
            job.cancelled = True
            self.num_cancelled += 1
            if self._jobs.get(job.key) is job:
                del self._jobs[job.key]
            queue = self._queues.get(job.client)
            if queue is not None and job in queue:
                queue.remove(job)
                if not queue:
                    del self._queues[job.client]
                return
            worker = job.worker
        if worker is not None:  # running: nobody waits for it any more
            worker.kill()


class _Worker:
    """One worker process and the daemon thread that feeds it, one job at a time."""

    def __init__(self, pool: GrammarCompilePool, index: int) -> None:
        self.pool = pool
        self.index = index
        self._lock = threading.Lock()
        self._process: Any = None
        self._conn: Any = None
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the feeding thread (the process starts with its first job). Pool lock held."""
        if self._thread is None:
            self._thread = threading.Thread(
                target=self._run, name=f"loraserve-grammar-{self.index}", daemon=True
            )
            self._thread.start()

    def kill(self) -> None:
        with self._lock:
            if self._process is not None:
                self._process.kill()

    def _run(self) -> None:
        while (job := self.pool._take(self)) is not None:
            try:
                result = self._compile(job)
            except BaseException as exc:
                self.pool._done(job, None, exc)
            else:
                self.pool._done(job, result, None)
        self.kill()

    def _compile(self, job: _Job) -> Any:
        conn = self._connection()
        if job.cancelled or self.pool._closed:
            raise GrammarCompileError("The request went away before its grammar compiled.")
        key, timeout = job.key, self.pool.settings.timeout_s
        start = time.monotonic()
        try:
            conn.send((key.kind, key.text, key.any_whitespace))
            answered = conn.poll(timeout)
            reply = conn.recv() if answered else None
        except (EOFError, OSError):  # killed: the ticket was withdrawn, or the pool is shutting down
            self._reset()
            raise GrammarCompileError(
                "The grammar compile was stopped (its request went away, or the worker exited).",
                job.parameter,
            ) from None
        if reply is None:
            self._reset()
            raise GrammarCompileTimeoutError(
                f"The {_constraint(key)} did not compile within {timeout:g} s "
                "(--structured-outputs-compile-timeout); simplify it.",
                job.parameter,
            )
        if reply[0] == "error":
            raise GrammarCompileError(reply[1], reply[2] or job.parameter)
        logger.debug("Compiled a %s grammar in %.3f s.", key.kind, time.monotonic() - start)
        return self.pool.load(key, reply[1])

    def _connection(self) -> Any:
        with self._lock:
            if self._process is not None and self._process.is_alive():
                return self._conn
        parent, child = _CONTEXT.Pipe()
        process = _WorkerProcess(
            target=compile_worker.serve,
            args=(child, self.pool.tokenizer_info()),
            name=f"loraserve-grammar-{self.index}",
            daemon=True,
        )
        process.start()
        child.close()
        with self._lock:
            self._process, self._conn = process, parent
        self.pool.num_workers_started += 1
        try:
            ready = parent.poll(WORKER_START_TIMEOUT_S) and parent.recv() == ("ready",)
        except (EOFError, OSError):
            ready = False
        if not ready:
            self._reset()
            raise RuntimeError("A grammar compile worker did not start.")
        return parent

    def _reset(self) -> None:
        """Kill and forget the process (a fresh one starts with the next job)."""
        with self._lock:
            process, conn = self._process, self._conn
            self._process = self._conn = None
        if process is not None:
            process.kill()
            process.join(5)
        if conn is not None:
            conn.close()


def _constraint(key: GrammarKey) -> str:
    return {"json": "JSON schema", "json_object": "JSON object constraint"}.get(
        key.kind, key.kind.replace("_", " ")
    )


def _settle(future: Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # cancelled by its request
        return
    try:
        if error is None:
            future.set_result(result)
        else:
            future.set_exception(error)
    except Exception:  # InvalidStateError: cancelled meanwhile
        pass
