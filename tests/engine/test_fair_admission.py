"""FairAdmission, the gate in front of the engine's queue: shares per request and per API key, a
bounded wait for room, round-robin turns by client, and no starvation of big calls by small ones.

Every wait here is decided by what holds the queue, never by timing: a test releases a hold and
checks who got in (the wait timeout is set far beyond any test, or to 0)."""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any

import pytest

from loraserve.config import SchedulerConfig
from loraserve.engine.fair_admission import AdmissionHold, FairAdmission
from loraserve.errors import EngineOverloadedError, RequestTooLargeError

LONG = 600.0  # a wait no test reaches: admission must come from a release


def _gate(reqs: int = 8, tokens: int = 1000, share: float = 0.5, wait: float = LONG) -> FairAdmission:
    return FairAdmission(
        SchedulerConfig(
            max_num_queued_reqs=reqs,
            max_num_queued_tokens=tokens,
            max_queued_share=share,
            queue_wait_timeout_s=wait,
        )
    )


def _run(coro: Coroutine[Any, Any, None]) -> None:
    asyncio.run(coro)


async def _settle() -> None:
    for _ in range(5):  # let woken waiters run
        await asyncio.sleep(0)


def test_one_request_beyond_its_share_is_400() -> None:
    async def main() -> None:
        gate = _gate(reqs=1024, tokens=1 << 18)
        with pytest.raises(RequestTooLargeError, match=r"1024 sequences.*512: --max-queued-share 0.5"):
            await gate.admit(1024, 8 * 3 * 128)  # the request: 8 prompts x n=128
        with pytest.raises(RequestTooLargeError, match="--max-num-queued-tokens"):
            await gate.admit(1, (1 << 17) + 1)
        hold = await gate.admit(512, 100)  # exactly its share fits
        assert gate.total.num_seqs == 512
        hold.release()
        assert gate.total.num_seqs == 0 and gate.total.num_prefill_tokens == 0

    _run(main())


def test_short_requests_get_in_while_one_request_holds_its_share() -> None:
    async def main() -> None:
        gate = _gate(reqs=8, wait=0)
        big = await gate.admit(4, 10)
        shorts = [await gate.admit(1, 1) for _ in range(4)]  # the other half is theirs
        with pytest.raises(EngineOverloadedError, match="busy"):
            await gate.admit(1, 1)  # now the queue is full: 503 at once (wait 0)
        big.release()
        shorts.append(await gate.admit(1, 1))
        assert gate.num_timed_out == 1

    _run(main())


def test_one_key_may_hold_only_its_share_and_waits_without_blocking_others() -> None:
    async def main() -> None:
        gate = _gate(reqs=8)
        first = await gate.admit(4, 10, "key-0")
        second = asyncio.create_task(gate.admit(2, 10, "key-0"))  # 4 + 2 > 4: waits for key-0's own
        await _settle()
        assert not second.done() and gate.num_waiting == 1
        other = await gate.admit(3, 10, "key-1")  # room in the queue: key-1 is not held up
        assert gate.total.num_seqs == 7
        first.release()
        held = await second
        assert held.held.num_seqs == 2 and gate.total.num_seqs == 5
        held.release()
        other.release()

    _run(main())


def test_a_key_over_its_share_gets_a_503_naming_its_share() -> None:
    async def main() -> None:
        gate = _gate(reqs=8, wait=0)
        await gate.admit(4, 10, "key-0")
        with pytest.raises(EngineOverloadedError, match="one key's share.*--max-queued-share") as err:
            await gate.admit(1, 1, "key-0")
        assert err.value.retry_after_s == 1
        await gate.admit(1, 1, "key-1")

    _run(main())


def test_waiters_take_turns_by_key_fifo_within_a_key() -> None:
    async def main() -> None:
        gate = _gate(reqs=4, share=1.0)
        blocker = await gate.admit(4, 4)
        order: list[str] = []
        holds: list[AdmissionHold] = []

        async def ask(name: str, key: str) -> None:
            holds.append(await gate.admit(1, 1, key))
            order.append(name)

        tasks = [asyncio.create_task(ask(f"a{i}", "key-a")) for i in range(3)]
        await _settle()
        tasks.append(asyncio.create_task(ask("b0", "key-b")))
        await _settle()
        assert gate.num_waiting == 4 and not order
        blocker.release()  # room for all four: turns go a, b, a, a
        await asyncio.gather(*tasks)
        assert order == ["a0", "b0", "a1", "a2"]

    _run(main())


def test_a_big_waiter_is_not_passed_by_later_small_ones() -> None:
    """No starvation of big calls: once a big call waits, small calls behind it wait too, and the room
    that frees up goes to it first."""

    async def main() -> None:
        gate = _gate(reqs=8)
        smalls = [await gate.admit(1, 1, f"key-{i}") for i in range(6)]
        big = asyncio.create_task(gate.admit(4, 4, "key-big"))
        await _settle()
        late = asyncio.create_task(gate.admit(1, 1, "key-late"))  # would fit (6 + 1 <= 8), but waits
        await _settle()
        assert not big.done() and not late.done()
        smalls[0].release()
        smalls[1].release()  # 4 held + 4 = 8: the big one's turn
        big_hold = await big
        await _settle()
        assert big_hold.held.num_seqs == 4 and not late.done()
        smalls[2].release()
        await late

    _run(main())


def test_a_waiter_that_times_out_gets_a_503_and_leaves_the_line() -> None:
    async def main() -> None:
        gate = _gate(reqs=4, share=1.0, wait=0.05)
        await gate.admit(4, 4)
        with pytest.raises(EngineOverloadedError, match="busy"):
            await gate.admit(2, 2)  # no room comes: 503 after the wait
        assert gate.num_waiting == 0 and gate.num_timed_out == 1 and gate.total.num_seqs == 4

    _run(main())


def test_a_waiter_whose_client_leaves_frees_its_place() -> None:
    async def main() -> None:
        gate = _gate(reqs=4, share=1.0)
        blocker = await gate.admit(4, 4)
        leaving = asyncio.create_task(gate.admit(4, 4))
        behind = asyncio.create_task(gate.admit(1, 1))
        await _settle()
        leaving.cancel()  # its client went away: the one behind it is next
        await _settle()
        blocker.release()
        await behind
        assert gate.total.num_seqs == 1

    _run(main())


def test_pieces_given_back_make_room() -> None:
    async def main() -> None:
        gate = _gate(reqs=100, tokens=20, share=1.0)
        hold = await gate.admit(2, 20)
        waiting = asyncio.create_task(gate.admit(1, 10))
        await _settle()
        assert not waiting.done()
        hold.prefilled(10)  # one prompt's tokens were processed
        await waiting
        hold.finished(2)
        assert (hold.held.num_seqs, hold.held.num_prefill_tokens) == (0, 10)
        async with hold:
            pass  # leaving the block gives back the rest
        assert (gate.total.num_seqs, gate.total.num_prefill_tokens) == (1, 10)  # the waiter's own

    _run(main())


def test_stats_report_each_admitted_calls_wait_once() -> None:
    async def main() -> None:
        gate = _gate(reqs=2, share=1.0)
        blocker = await gate.admit(2, 2)
        waiting = asyncio.create_task(gate.admit(1, 1))
        await _settle()
        assert gate.stats()["num_admission_waiting"] == 1
        blocker.release()
        await waiting
        stats = gate.stats()
        assert len(stats["admission_wait_seconds"]) == 1  # the waiter's (the first was drained before)
        assert stats["num_admission_waited"] == 1 and stats["num_admission_timeouts"] == 0
        assert gate.stats()["admission_wait_seconds"] == []

    _run(main())
