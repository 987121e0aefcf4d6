"""Fair admission: which API call gets the queue's room now, and which waits for it, in what order.

`FairAdmission` lives on the server's event loop, in front of the engine's exact check
(`admission.check_admission` on the engine thread, which stays the safety net). It counts what every
admitted call holds: its sequences (prompts x n) until each prompt finishes, its prompt tokens until
each prompt has been prefilled (every choice has a token). A call is admitted when
- it is within its share (`max_queued_share` of each limit; larger: RequestTooLargeError, a 400),
- its client's calls together stay within that same share (clients are API keys; a call without a
  key is a client of its own, so without keys only the per-request share applies: a peer address
  names a proxy as often as a person, and capping a proxy would cap everyone behind it),
- and the whole queue has room.
A client may also carry its own `ClientLimits` (an API key's, from the key file): at most so many
calls in flight and so many prompt tokens queued; they apply beside the share, the smaller winning.
A call that does not fit waits up to `queue_wait_timeout_s`, then gets EngineOverloadedError (503).
Waiters are served round-robin by client, FIFO within a client, and nobody passes the first waiter
in that order that the queue is too full for (so a big call is not starved by a stream of small
ones); a waiter held back only by its own client's share does not hold up anyone else.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict, deque
from collections.abc import Hashable
from dataclasses import dataclass, field

from loraserve.config import SchedulerConfig
from loraserve.engine.admission import RETRY_AFTER_S, check_request_size, share_limits
from loraserve.errors import EngineOverloadedError, RequestTooLargeError

MAX_RECORDED_WAITS = 4096  # admission waits kept for the next stats scrape (the oldest go first)


@dataclass(frozen=True, slots=True)
class ClientLimits:
    """One client's own limits (None: only the share applies)."""

    max_requests_in_flight: int | None = None  # API calls admitted and not yet done
    max_queued_tokens: int | None = None  # prompt tokens admitted and not yet prefilled


@dataclass(slots=True)
class Holding:
    num_seqs: int = 0
    num_prefill_tokens: int = 0
    num_calls: int = 0


class AdmissionHold:
    """One admitted call's part of the queue; given back piece by piece, the rest on `release`.

    An async context manager: leaving the block releases whatever is still held."""

    def __init__(self, gate: FairAdmission | None, client: Hashable, num_seqs: int, num_tokens: int) -> None:
        self._gate = gate
        self.client = client
        self.held = Holding(num_seqs, num_tokens, 1)

    def prefilled(self, num_tokens: int) -> None:
        """These prompt tokens have been processed: they no longer wait in front of anyone."""
        self._give_back(0, num_tokens)

    def finished(self, num_seqs: int, num_tokens: int = 0) -> None:
        """These sequences (and any of their prompt tokens still counted) have left the engine."""
        self._give_back(num_seqs, num_tokens)

    def release(self) -> None:
        self._give_back(self.held.num_seqs, self.held.num_prefill_tokens, self.held.num_calls)

    def _give_back(self, num_seqs: int, num_tokens: int, num_calls: int = 0) -> None:
        seqs, tokens = min(num_seqs, self.held.num_seqs), min(num_tokens, self.held.num_prefill_tokens)
        calls = min(num_calls, self.held.num_calls)
        if seqs == 0 and tokens == 0 and calls == 0:
            return
        self.held.num_seqs -= seqs
        self.held.num_prefill_tokens -= tokens
        self.held.num_calls -= calls
        if self._gate is not None:
            self._gate._give_back(self.client, seqs, tokens, calls)

    async def __aenter__(self) -> AdmissionHold:
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.release()


def unlimited_hold() -> AdmissionHold:
    """A hold that counts nothing: for engine clients that admit elsewhere (replicas)."""
    return AdmissionHold(None, None, 0, 0)


@dataclass(slots=True)
class _Waiter:
    client: Hashable
    num_seqs: int
    num_tokens: int
    future: asyncio.Future[AdmissionHold] = field(repr=False)
    limits: ClientLimits | None = None
    arrival: float = field(default_factory=time.monotonic)


class FairAdmission:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.share = share_limits(config)
        self.total = Holding()
        self._by_client: dict[Hashable, Holding] = {}
        self._waiting: OrderedDict[Hashable, deque[_Waiter]] = OrderedDict()  # first: the next turn
        self.num_waited = 0  # calls that found no room at once
        self.num_timed_out = 0  # ... and got their 503 after waiting
        self._waits: deque[float] = deque(maxlen=MAX_RECORDED_WAITS)  # seconds, per admitted call

    def stats(self) -> dict[str, object]:
        """For /metrics: the admitted calls' waits since the last call (a histogram), and gauges."""
        waits = []
        while self._waits:  # popleft is atomic: a scrape on another thread loses nothing
            waits.append(self._waits.popleft())
        return {
            "admission_wait_seconds": waits,
            "num_admission_waiting": self.num_waiting,
            "num_admission_waited": self.num_waited,
            "num_admission_timeouts": self.num_timed_out,
        }

    @property
    def num_waiting(self) -> int:
        return sum(len(queue) for queue in self._waiting.values())

    async def admit(
        self,
        num_seqs: int,
        num_prefill_tokens: int,
        client: str | None = None,
        limits: ClientLimits | None = None,
    ) -> AdmissionHold:
        """The call's hold once it fits; RequestTooLargeError beyond its share (or its client's own
        token limit), EngineOverloadedError when no room came within the wait."""
        check_request_size(self.config, num_seqs, num_prefill_tokens)
        if (
            limits is not None
            and limits.max_queued_tokens is not None
            and num_prefill_tokens > limits.max_queued_tokens
        ):
            raise RequestTooLargeError(
                f"This request has {num_prefill_tokens} prompt tokens to process (summed over prompts x n), "
                f"more than your API key may queue at once ({limits.max_queued_tokens}). Send fewer or "
                "shorter prompts, or a smaller n."
            )
        key: Hashable = client if client is not None else object()  # no key: a client of its own
        waiter = _Waiter(
            key, num_seqs, num_prefill_tokens, asyncio.get_running_loop().create_future(), limits
        )
        self._waiting.setdefault(key, deque()).append(waiter)
        self._pump()
        if waiter.future.done():
            return waiter.future.result()
        self.num_waited += 1
        try:
            return await asyncio.wait_for(asyncio.shield(waiter.future), self.config.queue_wait_timeout_s)
        except TimeoutError:
            if waiter.future.done():  # granted as the timer fired
                return waiter.future.result()
            self.num_timed_out += 1
            raise self._busy_error(waiter) from None
        except asyncio.CancelledError:  # the client left; if it was let in meanwhile, give the room back
            if waiter.future.done() and not waiter.future.cancelled():
                waiter.future.result().release()
            raise
        finally:
            if not waiter.future.done():  # still in line: leave it
                waiter.future.cancel()
                self._leave(waiter)

    def _client_fits(self, waiter: _Waiter) -> bool:
        holding = self._by_client.get(waiter.client)
        if holding is None:
            return True
        limits = waiter.limits or ClientLimits()
        calls, tokens = limits.max_requests_in_flight, limits.max_queued_tokens
        return (
            holding.num_seqs + waiter.num_seqs <= self.share.num_seqs
            and holding.num_prefill_tokens + waiter.num_tokens <= self.share.num_prefill_tokens
            and (calls is None or holding.num_calls + 1 <= calls)
            and (tokens is None or holding.num_prefill_tokens + waiter.num_tokens <= tokens)
        )

    def _queue_fits(self, waiter: _Waiter) -> bool:
        return (
            self.total.num_seqs + waiter.num_seqs <= self.config.max_num_queued_reqs
            and self.total.num_prefill_tokens + waiter.num_tokens <= self.config.max_num_queued_tokens
        )

    def _pump(self) -> None:
        """Admit waiters in turn until the first one in turn that the queue has no room for."""
        progress = True
        while progress:
            progress = False
            for key, queue in self._waiting.items():
                head = queue[0]
                if not self._client_fits(head):
                    continue  # held back by its own client's share: the others go on
                if not self._queue_fits(head):
                    return  # the room that frees up is this one's first
                queue.popleft()
                if not queue:
                    del self._waiting[key]
                else:
                    self._waiting.move_to_end(key)  # its next call waits for the other clients' turns
                self._grant(head)
                progress = True
                break

    def _grant(self, waiter: _Waiter) -> None:
        self.total.num_seqs += waiter.num_seqs
        self.total.num_prefill_tokens += waiter.num_tokens
        holding = self._by_client.setdefault(waiter.client, Holding())
        holding.num_seqs += waiter.num_seqs
        holding.num_prefill_tokens += waiter.num_tokens
        holding.num_calls += 1
        self._waits.append(time.monotonic() - waiter.arrival)
        waiter.future.set_result(AdmissionHold(self, waiter.client, waiter.num_seqs, waiter.num_tokens))

    def _give_back(self, client: Hashable, num_seqs: int, num_tokens: int, num_calls: int = 0) -> None:
        self.total.num_seqs -= num_seqs
        self.total.num_prefill_tokens -= num_tokens
        holding = self._by_client[client]
        holding.num_seqs -= num_seqs
        holding.num_prefill_tokens -= num_tokens
        holding.num_calls -= num_calls
        if holding.num_seqs <= 0 and holding.num_prefill_tokens <= 0 and holding.num_calls <= 0:
            del self._by_client[client]
        self._pump()

    def _leave(self, waiter: _Waiter) -> None:
        queue = self._waiting.get(waiter.client)
        if queue is not None and waiter in queue:
            queue.remove(waiter)
            if not queue:
                del self._waiting[waiter.client]
        self._pump()  # a blocked head that left may let the others in

    def _busy_error(self, waiter: _Waiter) -> EngineOverloadedError:
        if not self._client_fits(waiter):
            holding = self._by_client[waiter.client]
            limits = waiter.limits
            if limits is not None and (limits.max_requests_in_flight or limits.max_queued_tokens):
                return EngineOverloadedError(
                    f"Your API key has {holding.num_calls} requests in flight and {holding.num_prefill_tokens} "
                    f"prompt tokens queued; its limits are {limits.max_requests_in_flight} requests and "
                    f"{limits.max_queued_tokens} tokens (or its share: {self.share.num_seqs} sequences, "
                    f"{self.share.num_prefill_tokens} tokens). Retry once some of them finish.",
                    RETRY_AFTER_S,
                )
            return EngineOverloadedError(
                f"Your API key's requests already hold {holding.num_seqs} sequences and "
                f"{holding.num_prefill_tokens} prompt tokens of the queue; this request adds {waiter.num_seqs} "
                f"and {waiter.num_tokens}, over one key's share ({self.share.num_seqs} and "
                f"{self.share.num_prefill_tokens}, --max-queued-share {self.config.max_queued_share:g}). "
                "Retry once some of them finish.",
                RETRY_AFTER_S,
            )
        return EngineOverloadedError(
            f"The server is busy: {self.total.num_seqs} sequences and {self.total.num_prefill_tokens} prompt "
            f"tokens are queued or running and this request adds {waiter.num_seqs} and {waiter.num_tokens}, "
            f"over the limits of {self.config.max_num_queued_reqs} (--max-num-queued-reqs) and "
            f"{self.config.max_num_queued_tokens} (--max-num-queued-tokens). Retry later.",
            RETRY_AFTER_S,
        )
