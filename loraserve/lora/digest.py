"""Adapter content digests, hashed on background threads.

hashlib releases the GIL while it hashes a large buffer, so a digest computed on two threads costs
the loading thread nothing and uses both cores: it overlaps the parsing and the slot upload that
follow. A `HashPart` can also read its bytes from the file first, so the two halves of an adapter are
read (page faults and copy included) and hashed in parallel.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterable
from typing import Any


class HashPart:
    """sha256 of the buffers `chunks()` yields, computed on its own thread, after `read()` if given."""

    def __init__(self, chunks: Callable[[], Iterable[Any]], read: Callable[[], None] | None = None) -> None:
        self._chunks: Callable[[], Iterable[Any]] | None = chunks
        self._read = read
        self._loaded = threading.Event()
        self._error: BaseException | None = None
        self._digest: bytes | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            if self._read is not None:
                self._read()
        except BaseException as e:  # noqa: BLE001 - re-raised in the waiting thread
            self._error = e
        finally:
            self._loaded.set()
        if self._error is not None:
            return
        try:
            h = hashlib.sha256()
            assert self._chunks is not None
            for chunk in self._chunks():
                h.update(chunk)
            self._digest = h.digest()
        except BaseException as e:  # noqa: BLE001 - re-raised in the waiting thread
            self._error = e
        finally:
            # The registry keeps the digest as long as the adapter is registered: holding the
            # adapter's bytes here would keep every evicted adapter in memory.
            self._chunks = self._read = None

    def _raise_error(self) -> None:
        if self._error is not None:  # a stored error is raised again and again: keep its traceback short
            raise self._error.with_traceback(None)

    def done(self) -> bool:
        """Whether the hash is finished (or failed): `digest()` would not wait."""
        return not self._thread.is_alive()

    def wait_loaded(self) -> None:
        """Wait until the bytes are in place (the read is done); raises the read's error."""
        self._loaded.wait()
        self._raise_error()

    def digest(self) -> bytes:
        self._thread.join()
        self._raise_error()
        assert self._digest is not None
        return self._digest


class PendingDigest:
    """sha256(prefix, then each part's digest in order); `result()` waits for the parts."""

    def __init__(self, prefix: hashlib._Hash, parts: list[HashPart]) -> None:
        self._prefix, self._parts = prefix, parts
        self._digest: str | None = None
        self._lock = threading.Lock()  # result() may be called from several threads

    def done(self) -> bool:
        """Whether `result()` would return (or raise) without waiting for a hashing thread."""
        return self._digest is not None or all(part.done() for part in self._parts)

    def result(self) -> str:
        with self._lock:
            if self._digest is None:
                h = self._prefix.copy()
                for part in self._parts:
                    h.update(part.digest())
                self._digest = h.hexdigest()
            return self._digest
