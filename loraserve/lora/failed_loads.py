"""`FailedLoads`: adapters that failed to load, remembered by their files' identity so that the same
broken bytes fail fast instead of being read again on every request.

A resolver turns every request for a broken adapter into a new load, and a registered adapter whose
reload fails is retried by each of its requests: without memory, one bad adapter costs a full read
per request. An entry holds the error and a fingerprint of the adapter's files, (device, inode,
size, mtime_ns, ctime_ns) of the folder, adapter_config.json and each weights file name, taken
*before* the read. While the fingerprint is unchanged the same error is raised again after a few
stat calls; any change (a fixed file, a replaced folder) makes the next load read the files again.
Keys are client input, so the memory is a bounded LRU. The manager calls `check` before a read and
`record` after a failed one; nothing here reads an adapter or calls back.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Hashable
from dataclasses import dataclass

from loraserve.errors import LoRAAdapterError
from loraserve.lora.checkpoint import WEIGHT_FILES
from loraserve.lora.peft_helper import CONFIG_NAME

MAX_REMEMBERED = 256
_FILES = ("", CONFIG_NAME, *WEIGHT_FILES)  # "" is the folder itself

Fingerprint = tuple[tuple[int, int, int, int, int] | None, ...]


def fingerprint(folder: str) -> Fingerprint:
    """The identity of an adapter folder's files (None for each one missing or unreadable)."""
    stats: list[tuple[int, int, int, int, int] | None] = []
    for name in _FILES:
        try:
            st = os.stat(os.path.join(folder, name) if name else folder)
        except (OSError, ValueError):  # missing, a name too long, a NUL byte: nothing to read either
            stats.append(None)
            continue
        stats.append((st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns))
    return tuple(stats)


@dataclass(frozen=True, slots=True)
class _Failure:
    fingerprint: Fingerprint
    error_type: type[LoRAAdapterError]
    message: str


class FailedLoads:
    """Failed adapter loads by key (any thread)."""

    def __init__(self, capacity: int = MAX_REMEMBERED) -> None:
        self._capacity = capacity
        self._failures: OrderedDict[Hashable, _Failure] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._failures)

    def check(self, key: Hashable, folder: str) -> Fingerprint:
        """Raise the remembered error if `key` failed on exactly these files; else their fingerprint,
        to `record` should this attempt fail too."""
        current = fingerprint(folder)
        with self._lock:
            failure = self._failures.get(key)
            if failure is not None and failure.fingerprint != current:
                del self._failures[key]  # the files changed: try them again
                failure = None
            if failure is not None:
                self._failures.move_to_end(key)
        if failure is not None:
            raise failure.error_type(failure.message)  # a fresh exception: no traceback piles up
        return current

    def record(self, key: Hashable, files: Fingerprint, error: LoRAAdapterError) -> None:
        with self._lock:
            self._failures[key] = _Failure(files, type(error), str(error))
            self._failures.move_to_end(key)
            while len(self._failures) > self._capacity:
                self._failures.popitem(last=False)

    def forget(self, key: Hashable) -> None:
        with self._lock:
            self._failures.pop(key, None)
