"""Async-iterator plumbing for the serving layer: interleave several engine streams into one."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator, AsyncIterator
from contextlib import aclosing
from typing import Any, TypeVar

T = TypeVar("T")

_DONE = object()


async def _close(iterator: AsyncIterator[Any]) -> None:
    aclose = getattr(iterator, "aclose", None)
    if aclose is not None:
        await aclose()


async def merge_async_iterators(iterators: list[AsyncIterator[T]]) -> AsyncGenerator[tuple[int, T], None]:
    """Items of all `iterators` as (iterator index, item), in arrival order.

    The first exception from any iterator is raised; on any exit every iterator is closed, which is
    what tells the engine to abort the requests behind them.
    """
    if len(iterators) == 1:
        async with aclosing(iterators[0]) as only:  # type: ignore[type-var]
            async for item in only:
                yield 0, item
        return
    queue: asyncio.Queue[tuple[int, Any]] = asyncio.Queue()

    async def pump(index: int, iterator: AsyncIterator[T]) -> None:
        try:
            async for item in iterator:
                await queue.put((index, item))
            await queue.put((index, _DONE))
        except Exception as exc:
            await queue.put((index, exc))
        finally:
            await _close(iterator)

    tasks = [asyncio.create_task(pump(i, it)) for i, it in enumerate(iterators)]
    try:
        num_open = len(tasks)
        while num_open:
            index, item = await queue.get()
            if item is _DONE:
                num_open -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
