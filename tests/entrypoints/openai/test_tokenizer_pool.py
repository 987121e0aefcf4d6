"""FairTokenizerPool: work runs on several workers, and clients' queues take turns for them, so one
client's backlog of huge prompts does not sit in front of another client's short one."""

from __future__ import annotations

import asyncio
import threading

import pytest

from loraserve.entrypoints.openai.serving.tokenizer_pool import FairTokenizerPool


def test_queues_take_turns_by_client() -> None:
    async def main() -> list[str]:
        pool = FairTokenizerPool(num_workers=1)
        release = threading.Event()
        order: list[str] = []

        def job(name: str, wait: bool = False) -> str:
            if wait:
                release.wait(30)
            order.append(name)
            return name

        first = asyncio.create_task(pool.run("a", job, "a0", wait=True))  # holds the one worker
        await asyncio.sleep(0)
        backlog = [asyncio.create_task(pool.run("a", job, f"a{i}")) for i in range(1, 4)]
        await asyncio.sleep(0)
        short = asyncio.create_task(pool.run("b", job, "b0"))
        await asyncio.sleep(0)
        assert pool.num_queued == 4
        release.set()
        results = await asyncio.gather(first, *backlog, short)
        assert results == ["a0", "a1", "a2", "a3", "b0"]
        pool.shutdown()
        return order

    assert asyncio.run(main()) == ["a0", "b0", "a1", "a2", "a3"]  # b's one job next, not after a's backlog


def test_work_runs_on_more_than_one_worker_at_once() -> None:
    async def main() -> None:
        pool = FairTokenizerPool(num_workers=2)
        both_in = threading.Barrier(2, timeout=30)  # passes only when two jobs run at the same time
        await asyncio.gather(pool.run("a", both_in.wait), pool.run("a", both_in.wait))
        pool.shutdown()

    asyncio.run(main())


def test_errors_reach_the_caller_and_a_left_job_is_skipped() -> None:
    async def main() -> None:
        pool = FairTokenizerPool(num_workers=1)
        release = threading.Event()
        ran: list[str] = []

        def boom() -> None:
            raise ValueError("bad text")

        blocker = asyncio.create_task(pool.run(None, release.wait, 30))
        await asyncio.sleep(0)
        left = asyncio.create_task(pool.run(None, ran.append, "left"))
        await asyncio.sleep(0)
        left.cancel()  # its caller went away before a worker was free
        release.set()
        await blocker
        with pytest.raises(ValueError, match="bad text"):
            await pool.run(None, boom)
        assert await pool.run(None, ran.append, "next") is None
        assert ran == ["next"]
        pool.shutdown()

    asyncio.run(main())
