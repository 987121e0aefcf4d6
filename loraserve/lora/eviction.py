"""`ReloadCosts`: what bringing an evicted adapter back into host memory is expected to take.

The host cache's "cost" policy (`lru.LRUCache`) weighs each adapter by its expected reload seconds:
its size in bytes times the seconds per byte of its source. A source is where a reload reads from:
"s3" (the S3 resolver's local copies), "mix" (rebuilt from its adapters, mostly in host memory
already) or "local" (any other folder, Hub snapshots included: a reload never asks the Hub again).
The seconds per byte of a source start from a default bandwidth and then follow the loads measured
from it, an exponentially weighted moving average, so a slow store earns its adapters their keep
on the machine it runs on. Thread-safe: loads on any thread record, the engine thread asks.
"""

from __future__ import annotations

import os
import threading
from dataclasses import dataclass, field

from loraserve import envs
from loraserve.lora.request import MIX_PATH_PREFIX

# Until a source's first load is measured: bytes per second (a local NVMe read plus validation; an
# object store's copy; a mix is a concatenation in memory).
DEFAULT_BANDWIDTH = {"local": 1e9, "s3": 1e8, "mix": 1e10}
EWMA_WEIGHT = 0.2  # each measured load moves the estimate a fifth of the way
FIXED_SECONDS = 1e-3  # opening files and checking keys, whatever the size


def source_of(folder: str) -> str:
    """The source kind of an adapter read from `folder` (a `LoRAModel.path`)."""
    if folder.startswith(MIX_PATH_PREFIX):
        return "mix"
    s3_root = os.path.abspath(envs.lora_resolver_s3_cache_dir())
    if os.path.abspath(folder).startswith(s3_root + os.sep):
        return "s3"
    return "local"


@dataclass(slots=True)
class ReloadCosts:
    """Seconds per byte per source: defaults, then the EWMA of measured loads."""

    seconds_per_byte: dict[str, float] = field(default_factory=dict)
    num_measured: dict[str, int] = field(default_factory=dict)
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, source: str, num_bytes: int, seconds: float) -> None:
        """A load of `num_bytes` from `source` took `seconds` (its fixed part taken off)."""
        if num_bytes <= 0 or seconds < 0:
            return
        measured = max(seconds - FIXED_SECONDS, 0.0) / num_bytes
        with self._lock:
            count = self.num_measured.get(source, 0)
            old = self.seconds_per_byte.get(source)
            self.seconds_per_byte[source] = (
                measured if old is None or count == 0 else (1 - EWMA_WEIGHT) * old + EWMA_WEIGHT * measured
            )
            self.num_measured[source] = count + 1

    def rate(self, source: str) -> float:
        """Seconds per byte from `source` (the default bandwidth's until measured)."""
        with self._lock:
            rate = self.seconds_per_byte.get(source)
        return rate if rate is not None else 1.0 / DEFAULT_BANDWIDTH.get(source, DEFAULT_BANDWIDTH["local"])

    def expected_seconds(self, folder: str, num_bytes: int) -> float:
        """The expected reload time of an adapter of `num_bytes` read from `folder`."""
        return FIXED_SECONDS + max(num_bytes, 0) * self.rate(source_of(folder))
