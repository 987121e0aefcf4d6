"""How many paged KV-cache blocks an engine gets: `--kv-cache-memory` when given, else
VLLM_CPU_KVCACHE_SPACE (GiB), else a share of the machine.

The share: `AUTO_SHARE` of the memory available once the model is loaded (CPU: /proc/meminfo's
MemAvailable; CUDA: the device's free memory), never more than `max_num_seqs` sequences of
`max_model_len` tokens could hold (more would never be used), never less than one such sequence. On CPU
the cache is an anonymous mapping committed page by page as blocks are first written
(`native/huge_pages.zeros(huge=False)`), so a large budget costs address space, not resident memory,
until sequences fill it (`allocate_kv_caches`). A block's bytes are those of the cache's element dtype
(`--kv-cache-dtype`: fp8 and int8 hold 2x a bf16 model's tokens, 4x a float32 one's; int8's block scales
counted), so the same memory holds more tokens. The chosen size is logged, and so is preemption
(`PreemptionWarning`): a cache too small for the running batch makes the scheduler recompute
sequences, which a user should hear about."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from loraserve import envs
from loraserve.batch.kv_cache import FP8_DTYPES, KVCache, KVScales, has_block_scales
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.cache_config import kv_cache_torch_dtype
from loraserve.config import CacheConfig
from loraserve.native import huge_pages

logger = logging.getLogger(__name__)

AUTO_SHARE = 0.25
FALLBACK_BYTES = 1 << 30  # where the available memory cannot be read


@dataclass(frozen=True, slots=True)
class KVBudget:
    num_blocks: int
    bytes: int
    source: str  # "--kv-cache-memory", "VLLM_CPU_KVCACHE_SPACE", "num_kv_blocks" or "auto"


def available_memory_bytes(device: str | torch.device) -> int | None:
    """Memory a new allocation can take now: the device's free memory (CUDA) or MemAvailable (CPU)."""
    if torch.device(device).type == "cuda":
        free, _ = torch.cuda.mem_get_info(torch.device(device))
        return int(free)
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def kv_budget(
    cache: CacheConfig,
    spec: KVCacheSpec,
    dtype: torch.dtype,
    device: str | torch.device,
    max_model_len: int,
    max_num_seqs: int,
) -> KVBudget:
    """The blocks this engine's KV cache gets, and where the size came from; `dtype` is the cache's
    element dtype (`cache_config.kv_cache_torch_dtype`)."""
    per_block = spec.block_bytes(cache.block_size, dtype)
    per_sequence = -(-max_model_len // cache.block_size)
    if cache.num_blocks is not None:
        return KVBudget(cache.num_blocks, cache.num_blocks * per_block, "num_kv_blocks")
    if cache.kv_cache_memory_bytes is not None:
        size, source = cache.kv_cache_memory_bytes, "--kv-cache-memory"
    elif (space := envs.cpu_kvcache_space_bytes()) is not None:
        size, source = space, "VLLM_CPU_KVCACHE_SPACE"
    else:
        available = available_memory_bytes(device)
        share = FALLBACK_BYTES if available is None else int(available * AUTO_SHARE)
        useful = max_num_seqs * per_sequence * per_block
        size, source = max(min(share, useful), per_sequence * per_block), "auto"
    num_blocks = size // per_block
    logger.info(
        "KV cache: %.2f GiB, %d blocks of %d tokens in %s (%s; %d sequences of max_model_len=%d fit)",
        num_blocks * per_block / (1 << 30),
        num_blocks,
        cache.block_size,
        str(dtype).removeprefix("torch."),
        source,
        num_blocks // per_sequence,
        max_model_len,
    )
    return KVBudget(num_blocks, num_blocks * per_block, source)


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element dtype for `--kv-cache-dtype`; fp8 says, as vLLM does, that its scales are 1.0."""
    dtype = kv_cache_torch_dtype(name, model_dtype)
    if dtype in FP8_DTYPES:
        logger.warning(
            "Using KV cache scaling factor 1.0 for %s (vLLM's default without calibrated k/v scales): K and V "
            "values beyond %g are saturated. int8 (--kv-cache-dtype int8) keeps a scale per block instead.",
            name,
            torch.finfo(dtype).max,
        )
    return dtype


def allocate_kv_caches(
    spec: KVCacheSpec, num_blocks: int, block_size: int, dtype: torch.dtype, device: str | torch.device
) -> list[KVCache]:
    """Every layer's cache, zero-filled, from one anonymous mapping committed as blocks are first
    written (`huge_pages.zeros(huge=False)`): a large budget costs address space until it is used."""
    rows: huge_pages.Spec = ((num_blocks * block_size, spec.num_kv_heads, spec.head_dim), dtype)
    specs = [rows, rows]
    if has_block_scales(dtype):  # K's and V's float32 scale per (block, KV head)
        specs += [((num_blocks, spec.num_kv_heads), torch.float32)] * 2
    per_layer = len(specs)
    tensors = huge_pages.zeros(specs * spec.num_layers, device, huge=False)
    caches = []
    for i in range(spec.num_layers):
        k, v, *blocks = tensors[i * per_layer : (i + 1) * per_layer]
        scales = KVScales(k_blocks=blocks[0], v_blocks=blocks[1]) if blocks else KVScales()
        caches.append(KVCache(k, v, scales))
    return caches


PREEMPTION_WARN_S = 10.0


@dataclass(slots=True)
class PreemptionWarning:
    """vLLM's warning when sequences are preempted for want of KV blocks, at most every
    PREEMPTION_WARN_S seconds, with the cumulative count (`num_preemptions` in stats and metrics)."""

    num_blocks: int
    last: float = field(default=-PREEMPTION_WARN_S)

    def note(self, count: int, total: int) -> None:
        now = time.monotonic()
        if now - self.last < PREEMPTION_WARN_S:
            return
        self.last = now
        logger.warning(
            "%d sequence(s) preempted to be recomputed later: the KV cache (%d blocks) is too small for the "
            "running batch; total_num_cumulative_preemption=%d. Raise --kv-cache-memory (or "
            "VLLM_CPU_KVCACHE_SPACE) or lower --max-num-seqs.",
            count,
            self.num_blocks,
            total,
        )
