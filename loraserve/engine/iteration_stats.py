"""What each engine step did, for vLLM's `vllm:iteration_tokens_total` histogram, and the cache
config as vLLM's `vllm:cache_config_info` labels.

`IterationTokens` keeps the histogram as bucket counts (fixed size however long the engine runs; the
engine thread writes, a scrape copies). A step's tokens are those its forward computed: prefill
(chunk) tokens plus one per decoding sequence, what vLLM's buckets (its CUDA-graph batch sizes) are
about.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Any

from loraserve.config import CacheConfig

# vLLM's buckets when no CUDA graphs are captured (v0.11 `build_cudagraph_buckets`, enforce_eager).
ITERATION_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


@dataclass(slots=True)
class IterationTokens:
    """Tokens per engine step, as a histogram: per-bucket counts (the last is +Inf) and the sum."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(ITERATION_TOKEN_BUCKETS) + 1))
    total: int = 0
    _lock: threading.Lock = field(default_factory=threading.Lock)

    def observe(self, num_tokens: int) -> None:
        with self._lock:  # a scrape on another thread sees counts and sum of the same steps
            self.counts[bisect_left(ITERATION_TOKEN_BUCKETS, num_tokens)] += 1
            self.total += num_tokens

    def snapshot(self) -> dict[str, Any]:
        """{"buckets": upper bounds, "counts": per bucket (+Inf last, not cumulative), "sum"}."""
        with self._lock:
            return {"buckets": list(ITERATION_TOKEN_BUCKETS), "counts": list(self.counts), "sum": self.total}


def cache_config_info(cache: CacheConfig, num_blocks: int, kv_bytes: int) -> dict[str, str]:
    """vLLM's CacheConfig fields that mean something here, as strings (vLLM's `metrics_info()`):
    the KV blocks, on whatever device, are vLLM's `num_gpu_blocks`; no blocks are swapped to the CPU
    (`num_cpu_blocks` None, as vLLM v1 leaves it); `cache_dtype` is `--kv-cache-dtype` as given."""
    return {
        "block_size": str(cache.block_size),
        "cache_dtype": cache.kv_cache_dtype,
        "enable_prefix_caching": str(cache.enable_prefix_caching),
        "kv_cache_memory_bytes": str(kv_bytes),
        "num_gpu_blocks": str(num_blocks),
        "num_cpu_blocks": "None",
    }
