"""`NamedLocks`: one asyncio lock per adapter name, held while the name is resolved, loaded or unloaded."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field


@dataclass(slots=True)
class _LockEntry:
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    num_users: int = 0


class NamedLocks:
    """One asyncio lock per name, dropped when nobody holds or waits for it (names are client input)."""

    def __init__(self) -> None:
        self._entries: dict[str, _LockEntry] = {}

    @asynccontextmanager
    async def hold(self, name: str) -> AsyncIterator[None]:
        entry = self._entries.setdefault(name, _LockEntry())
        entry.num_users += 1
        try:
            async with entry.lock:
                yield
        finally:
            entry.num_users -= 1
            if entry.num_users == 0:
                del self._entries[name]

    def num_users(self, name: str) -> int:
        """Holders and waiters of `name`'s lock."""
        entry = self._entries.get(name)
        return entry.num_users if entry is not None else 0

    def __len__(self) -> int:
        return len(self._entries)
