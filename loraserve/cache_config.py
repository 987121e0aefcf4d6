"""`CacheConfig`: the paged KV cache's options (block size, memory budget, prefix caching, element
dtype), and what `--kv-cache-dtype`'s spellings mean.

The KV dtypes are vLLM's spellings plus an `int8` of loraserve's own: "auto" keeps the model's dtype,
"bfloat16" stores bf16, "fp8" (= "fp8_e4m3", as in vLLM) and "fp8_e5m2" store float8 values of K/V
divided by a per-tensor scale of 1.0 (vLLM's scale when a checkpoint brings none and
`--calculate-kv-scales` is off), and "int8" stores int8 with a float32 scale per (block, KV head) for
K and V each (`batch/kv_cache.py` says how a block's scale is kept as its rows arrive). Torch is
imported only where a dtype is resolved, so flag parsing never waits for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from loraserve.option_types import positive_int
from loraserve.options import check_options, option

if TYPE_CHECKING:
    import torch

CACHE_GROUP = "scheduler and cache"  # the --help section of the cache and scheduler flags

# Served spellings; vLLM's others are refused by name (`_served_kv_dtype`).
KV_CACHE_DTYPES = ("auto", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "int8")
_VLLM_ONLY_KV_DTYPES = {
    "fp8_inc": "Intel Gaudi's fp8 (INC) needs HPU kernels",
    "fp8_ds_mla": "DeepSeek's fp8 MLA cache needs MLA models, which are not served",
}


def _served_kv_dtype(name: str) -> str | None:
    if name in KV_CACHE_DTYPES:
        return None
    why = _VLLM_ONLY_KV_DTYPES.get(name)
    served = ", ".join(KV_CACHE_DTYPES)
    if why is not None:
        return f"{name!r} is not served ({why}); use one of {served}."
    return f"{name!r} is not a KV-cache dtype; use one of {served}."


def kv_cache_torch_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The element dtype of the cache tensors for a `--kv-cache-dtype` spelling."""
    import torch

    if name == "auto":
        return model_dtype
    names = {
        "bfloat16": torch.bfloat16,
        "fp8": torch.float8_e4m3fn,
        "fp8_e4m3": torch.float8_e4m3fn,
        "fp8_e5m2": torch.float8_e5m2,
        "int8": torch.int8,
    }
    if name not in names:
        raise ValueError(_served_kv_dtype(name) or f"{name!r} is not a KV-cache dtype.")
    return names[name]


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size, the memory budget that sets the number of blocks, the element dtype."""

    block_size: int = option(
        16, type=positive_int, group=CACHE_GROUP, help="Tokens per KV-cache block (default: %(default)s)."
    )
    kv_cache_memory_bytes: int | None = option(
        None,
        flag=("--kv-cache-memory", "--kv-cache-memory-bytes"),
        metavar="KV_CACHE_MEMORY",
        type=positive_int,
        group=CACHE_GROUP,
        help="Bytes for the KV cache, e.g. 512MiB or 4GiB (default: VLLM_CPU_KVCACHE_SPACE GiB if set, else "
        "a quarter of the memory available once the model is loaded, at most what max_num_seqs "
        "sequences of max_model_len tokens need; pages are committed as blocks are first written).",
    )
    num_blocks: int | None = None  # overrides the memory budget when set (EngineArgs.num_kv_blocks)
    enable_prefix_caching: bool = option(
        True,
        action="bool",
        group=CACHE_GROUP,
        help="Reuse KV blocks of shared prompt prefixes (keyed by adapter too).",
    )
    kv_cache_dtype: str = option(
        "auto",
        choices=(*KV_CACHE_DTYPES, *_VLLM_ONLY_KV_DTYPES),
        check=_served_kv_dtype,
        group=CACHE_GROUP,
        help="KV-cache element dtype: auto (the model's), bfloat16, fp8 (= fp8_e4m3) or fp8_e5m2 (scale "
        "1.0, as vLLM without calibrated scales), or int8 (loraserve only: a float32 scale per block "
        "and KV head). 8-bit values hold 2x (bf16 models) or 4x (float32) the tokens in the same "
        "memory; attention reads them in place (default: auto).",
    )

    def __post_init__(self) -> None:
        check_options(self)
