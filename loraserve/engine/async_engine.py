"""AsyncLLMEngine: the LLMEngine driven by a background thread, streamed to asyncio consumers.

The forward pass blocks for a whole step, so it runs on its own thread; the event loop only enqueues
commands (add, abort, adapter changes) and receives outputs. Every command carries a Future, so
validation errors surface in the caller's coroutine. A step that raises fails only its own requests
(`LLMEngine.step` drops them and returns their error outputs); only when the engine cannot continue
(StepFailureLimitError, or anything else escaping `step`) does every request fail, the engine is
marked dead and /health reports it.

Admission: the serving layer asks `admit` for each API call before its requests start; the
`FairAdmission` gate (on the event loop) gives out the queue's room fairly by client and lets a call
wait a bounded time for room; `add_request`'s own check on the engine thread stays the exact net.

Work that must not stall the step loop runs elsewhere, each kind on its own pool: a new grammar on
the compile worker processes (`structured_output/compile_pool.py`: timed out, fair by client, killed
when its request goes away; a cached grammar is looked up on the event loop and never waits), adapter
reads and digests on the adapter I/O threads (`lora/adapter_io.py`). Shutdown waits for neither.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

from loraserve.beam_search import BeamSearchParams
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.fair_admission import AdmissionHold, ClientLimits, FairAdmission
from loraserve.engine.heap_trim import HeapTrimmer
from loraserve.engine.llm_engine import LLMEngine
from loraserve.engine.step_failures import StepFailureLimitError
from loraserve.errors import EngineDeadError, EngineShutdownError
from loraserve.lora.adapter_io import run_adapter_io
from loraserve.outputs import RequestOutput
from loraserve.sampling_params import SamplingParams
from loraserve.structured_output.params import StructuredOutputsParams

if TYPE_CHECKING:
    from loraserve.lora.request import LoRARequest

logger = logging.getLogger(__name__)
_Command = tuple[Callable[[LLMEngine], Any], concurrent.futures.Future]


class _Stream:
    """Delivers one request's outputs from the engine thread to its asyncio consumer."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


class AsyncLLMEngine:
    def __init__(self, engine: LLMEngine, compile_workers: int = 2, compile_timeout_s: float = 10.0) -> None:
        """`compile_workers` / `compile_timeout_s`: the grammar compile pool (EngineArgs'
        structured_outputs_compile_*; the offline engine compiles in its own thread, untimed)."""
        self.engine = engine
        self.compile_workers = compile_workers
        self.compile_timeout_s = compile_timeout_s
        self.model_config = engine.model_config
        self.tokenizer = engine.tokenizer
        self.lora_config = engine.lora_config
        self.scheduler_config = engine.config.scheduler
        self.admission = FairAdmission(self.scheduler_config)
        self._commands: queue.Queue[_Command] = queue.Queue()
        self._streams: dict[str, _Stream] = {}
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._closed = False
        self._waiters: set[concurrent.futures.Future[None]] = set()  # `_until` calls in progress
        self.dead_error: BaseException | None = None
        self._heap = HeapTrimmer()  # the engine thread returns freed memory to the OS between steps

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(
            LLMEngine.from_engine_args(args),
            args.structured_outputs_compile_workers,
            args.structured_outputs_compile_timeout,
        )

    @property
    def errored(self) -> bool:
        return self.dead_error is not None

    def is_healthy(self) -> bool:
        alive = self._thread is None or self._thread.is_alive()
        return self.dead_error is None and not self._closed and alive

    async def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="loraserve-engine", daemon=True)
            self._thread.start()

    async def shutdown(self) -> None:
        """Stop the step loop; requests still open fail with EngineDeadError, later calls too."""
        self._closed = True
        self.engine.structured.stop_compiles()  # kills them: a shutdown waits for no compile
        self._stop.set()
        if self._thread is not None:
            await run_adapter_io(self._thread.join, 30)
        self._fail_pending(EngineShutdownError("The server is shutting down; the request did not finish."))

    # ---- engine thread --------------------------------------------------------------------------
    def _loop(self) -> None:
        while not self._stop.is_set():
            self._drain_commands(block=not self.engine.has_unfinished_requests())
            self._heap.maybe_trim()
            if self.dead_error is not None or not self.engine.has_unfinished_requests():
                continue
            try:
                outputs = self.engine.step()
            except StepFailureLimitError as exc:  # the failed step is logged with its traceback already
                logger.error("The engine cannot continue, failing all requests: %s", exc)
                self._die(exc)
                continue
            except BaseException as exc:  # an escape from the step's own recovery: nothing is trusted
                logger.exception("Engine step failed; failing all running requests")
                self._die(exc)
                continue
            for output in outputs:
                self._deliver(output)

    def _drain_commands(self, block: bool) -> None:
        try:
            command: _Command | None = (
                self._commands.get(timeout=0.1) if block else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while command is not None:
            self._run_command(command)
            command = self._next_command()

    def _run_command(self, command: _Command) -> None:
        fn, future = command
        if not future.set_running_or_notify_cancel():
            return
        if self.dead_error is not None:  # queued before the crash: refuse, never run
            future.set_exception(EngineDeadError(f"The engine is dead: {self.dead_error}"))
            return
        try:
            future.set_result(fn(self.engine))
        except BaseException as exc:
            future.set_exception(exc)

    def _deliver(self, output: RequestOutput) -> None:
        stream = self._streams.get(output.request_id)
        if stream is not None:
            stream.put(output)
            if output.finished:
                self._streams.pop(output.request_id, None)

    def _next_command(self) -> _Command | None:
        try:
            return self._commands.get_nowait()
        except queue.Empty:
            return None

    def _die(self, exc: BaseException) -> None:
        self.dead_error = exc
        self._fail_pending(
            EngineDeadError(f"The engine failed while running a batch: {type(exc).__name__}: {exc}")
        )
        try:
            self.engine.abort_request(list(self.engine.requests))
        except Exception:  # the engine is already broken; its state no longer matters
            logger.exception("Cleaning up after the failed step also failed")

    def _fail_pending(self, error: EngineDeadError) -> None:
        for waiter in list(self._waiters):
            _settle(waiter, error)
        for request_id, stream in list(self._streams.items()):
            stream.put(error)
            self._streams.pop(request_id, None)
        while (command := self._next_command()) is not None:
            if command[1].set_running_or_notify_cancel():
                command[1].set_exception(error)

    async def _call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine is dead: {self.dead_error}")
        if self._closed:
            raise EngineShutdownError("The server is shutting down and accepts no new requests.")
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._commands.put((fn, future))
        if self._thread is None:  # not started: run inline (tests, offline use)
            self._drain_commands(block=False)
        return await asyncio.wrap_future(future)

    # ---- public API -----------------------------------------------------------------------------
    async def generate(
        self,
        prompt: str | list[int] | dict[str, Any],
        sampling_params: SamplingParams | BeamSearchParams,
        request_id: str,
        lora_request: LoRARequest | None = None,
        group_id: str | None = None,
        priority: int = 0,
        client_id: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs until finished; aborts the request if the consumer stops early.
        Requests sharing a `group_id` (the prompts of one API call) take scheduling turns as one;
        `priority` (lower first) needs scheduling_policy "priority"; `client_id` is whose turn and
        share a new grammar's compile counts in (None: a client of its own)."""
        stream = _Stream(asyncio.get_running_loop())
        await self._prefetch(lora_request)
        grammar = None
        if sampling_params.structured_outputs is not None:
            # Compiled before the request is queued, so a bad one fails here and the step loop never
            # compiles: the grammar goes to add_request with the request.
            grammar = await self._grammar(sampling_params.structured_outputs, client_id)

        def add(engine: LLMEngine) -> None:
            engine.add_request(
                request_id,
                prompt,
                sampling_params,
                lora_request,
                group_id=group_id,
                priority=priority,
                grammar=grammar,
            )
            self._streams[request_id] = stream

        try:
            await self._call(add)
        except asyncio.CancelledError:
            await self.abort(request_id)  # the add may have run before the cancellation landed
            raise
        finished = False
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                await self.abort(request_id)

    async def admit(
        self,
        num_seqs: int,
        num_prefill_tokens: int,
        client_id: str | None = None,
        limits: ClientLimits | None = None,
    ) -> AdmissionHold:
        """Room in the queue for one API call (prompts x n sequences, their prompt tokens), held until
        the hold is released: at once, or after a bounded wait in turn by client (`FairAdmission`)."""
        if self.dead_error is not None:
            raise EngineDeadError(f"The engine is dead: {self.dead_error}")
        if self._closed:
            raise EngineShutdownError("The server is shutting down and accepts no new requests.")
        return await self.admission.admit(num_seqs, num_prefill_tokens, client_id, limits)

    async def check_admission(self, num_seqs: int, num_prefill_tokens: int) -> None:
        """EngineOverloadedError unless a request of this size fits the queue now (on the engine thread,
        so it sees the queue as the next adds will)."""
        await self._call(lambda engine: engine.check_admission(num_seqs, num_prefill_tokens))

    async def abort(self, request_id: str) -> None:
        def abort(engine: LLMEngine) -> None:
            # A consumer still iterating gets the final 'abort' output instead of waiting forever.
            for output in engine.abort_request(request_id):
                self._deliver(output)
            self._streams.pop(request_id, None)

        if self.dead_error is None and not self._closed:
            await self._call(abort)

    async def _grammar(self, params: StructuredOutputsParams, client_id: str | None) -> Any:
        """The request's compiled grammar: from the cache at once, else from the compile pool (in turn
        by client, bounded in time); the compile is withdrawn if this request goes away meanwhile."""
        structured = self.engine.structured
        key = structured.key(params)  # over the budget: a ValueError naming the field, nothing queued
        found = structured.cached(key)
        if found is not None:
            return found
        from loraserve.structured_output.compile_pool import CompileSettings  # imports xgrammar

        share = self.scheduler_config.max_queued_share
        pool = structured.compile_pool(CompileSettings(self.compile_workers, self.compile_timeout_s, share))
        ticket = pool.submit(key, client_id if client_id is not None else object(), params.param)
        try:
            return await asyncio.wrap_future(ticket.future)
        finally:  # cancelled, or the generator closed while it waited: nobody wants this compile now
            if not ticket.future.done() or ticket.future.cancelled():
                ticket.cancel()

    async def _prefetch(self, lora_request: LoRARequest | None) -> None:
        """Read and validate a new adapter on an adapter I/O thread, so the step loop never stalls on
        disk; the engine thread then finds it cached (each adapter is read once, however many ask)."""
        if lora_request is not None and not self.engine.is_lora_registered(lora_request.lora_id):
            await run_adapter_io(self.engine.prefetch_lora, lora_request)

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        await self._prefetch(lora_request)
        return bool(await self._call(lambda engine: engine.add_lora(lora_request)))

    async def replace_lora(self, old_lora_id: int, lora_request: LoRARequest) -> bool:
        """load_inplace: `lora_request` (a new id) serves from the next step; the old adapter's running
        requests finish on its weights and it goes once they are done (not awaited here)."""
        if not self.engine.is_lora_registered(lora_request.lora_id):  # read off the step loop
            running = await self._call(lambda engine: engine.is_lora_in_use(old_lora_id))
            keep = (old_lora_id,) if running else ()  # the old copy may be all its requests have left
            await run_adapter_io(self.engine.prefetch_lora, lora_request, keep)
        return bool(await self._call(lambda engine: engine.replace_lora(old_lora_id, lora_request)))

    async def remove_lora(self, lora_id: int) -> bool:
        """Unregister an adapter; returns once its running requests have finished."""

        def remove(engine: LLMEngine) -> concurrent.futures.Future[None] | None:
            return engine.lora_removed(lora_id) if engine.remove_lora(lora_id) else None

        removed = await self._call(remove)
        if removed is None:
            return False
        await self._until(removed)
        return True

    async def _until(self, done: concurrent.futures.Future[None]) -> None:
        """Wait for something the engine thread completes; EngineDeadError if the engine stops first."""
        waiter: concurrent.futures.Future[None] = concurrent.futures.Future()
        done.add_done_callback(lambda _: _settle(waiter, None))
        self._waiters.add(waiter)
        try:
            await asyncio.wrap_future(waiter)
        finally:
            self._waiters.discard(waiter)

    async def pin_lora(self, lora_id: int) -> bool:
        return bool(await self._call(lambda engine: engine.pin_lora(lora_id)))

    async def list_loras(self) -> list[LoRARequest]:
        return list(await self._call(lambda engine: engine.list_loras()))

    async def lora_digest(self, lora_id: int) -> str:
        """The content digest of a registered adapter (hashed off the event loop)."""
        return await run_adapter_io(self.engine.lora_digest, lora_id)

    def lora_version_residency(self) -> dict[str, str]:
        """Version keys ("name@<12 digest digits>") -> "slot" / "host" (`LLMEngine.lora_version_residency`)."""
        return self.engine.lora_version_residency()

    def lora_residency(self) -> dict[str, str]:
        """Adapter name -> "slot" (in a compute slot) or "host" (in memory only), for routing."""
        return self.engine.lora_residency()

    def stats(self) -> dict[str, Any]:
        """The engine's stats; its lists (adapter load latencies) are new since the previous scrape."""
        try:
            stats = dict(self.engine.stats())
        except RuntimeError:  # dict changed size while the engine thread runs: report next scrape
            stats = {}
        # The gate and the grammar compiles live on this (the event loop's) side.
        return {**stats, **self.admission.stats(), **self.engine.structured.compile_stats()}


def _settle(future: concurrent.futures.Future[None], error: BaseException | None) -> None:
    """Complete `future` unless it already is (the engine thread and a shutdown may race to it)."""
    try:
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)
    except concurrent.futures.InvalidStateError:
        pass
