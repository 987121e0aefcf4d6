"""Every environment variable loraserve reads, in one place.

Each is read as LORASERVE_<NAME>; the vLLM spelling VLLM_<NAME> is accepted as an alias so a vLLM user's
environment works unchanged. The canonical name wins when both are set. Values are read at call time,
never cached, so tests and plugins can change them.
"""

from __future__ import annotations

import os

_PREFIXES = ("LORASERVE_", "VLLM_")


def get_env(name: str, default: str | None = None) -> str | None:
    """Raw value of LORASERVE_<name> or VLLM_<name> (canonical first); `default` if neither is set."""
    for prefix in _PREFIXES:
        value = os.environ.get(prefix + name)
        if value is not None:
            return value
    return default


def _is_true(value: str | None) -> bool:
    return value is not None and value.strip().lower() in ("1", "true")


def _switch(name: str) -> bool:
    """A default-on switch: off only for "0" or "false" (any case, spaces ignored)."""
    return (get_env(name) or "1").strip().lower() not in ("0", "false")


def allow_long_max_model_len() -> bool:
    """vLLM's VLLM_ALLOW_LONG_MAX_MODEL_LEN: a max_model_len beyond the model config's is served
    (with a warning) instead of refused; "1" or "true"."""
    return _is_true(get_env("ALLOW_LONG_MAX_MODEL_LEN"))


def allow_runtime_lora_updating() -> bool:
    """Runtime load/unload routes and resolvers are on only for "1" or "true" (any case)."""
    return _is_true(get_env("ALLOW_RUNTIME_LORA_UPDATING", "0"))


def plugins() -> list[str] | None:
    """Plugin allowlist: None (unset) = load all; [] (empty string) = load none; else the names."""
    value = get_env("PLUGINS")
    if value is None:
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def lora_resolver_cache_dir() -> str | None:
    return get_env("LORA_RESOLVER_CACHE_DIR")


def lora_resolver_hf_repo_list() -> list[str]:
    value = get_env("LORA_RESOLVER_HF_REPO_LIST")
    if not value:
        return []
    return [repo.strip() for repo in value.split(",") if repo.strip()]


def lora_resolver_s3_bucket() -> str | None:
    """The bucket of the S3 adapter store; the S3 resolver registers only when it is set."""
    return get_env("LORA_RESOLVER_S3_BUCKET") or None


def lora_resolver_s3_prefix() -> str:
    """Key prefix of the adapters in the bucket: adapter N lives under `<prefix>/N/`."""
    return get_env("LORA_RESOLVER_S3_PREFIX", "") or ""


def lora_resolver_s3_endpoint_url() -> str | None:
    """An S3-compatible endpoint (MinIO, R2, moto); unset: AWS, or boto3's own AWS_ENDPOINT_URL."""
    return get_env("LORA_RESOLVER_S3_ENDPOINT_URL") or None


def lora_resolver_s3_region() -> str | None:
    return get_env("LORA_RESOLVER_S3_REGION") or None


def lora_prefetch() -> bool:
    """Read back, beside the step, the evicted adapters that queued requests need (default on; "0"
    leaves them to the step's own load). Read when an engine's LoRA manager is built."""
    return _switch("LORA_PREFETCH")


def lora_eviction_policy() -> str | None:
    """LORA_EVICTION_POLICY, the env twin of --lora-eviction-policy ("lru" or "cost"); None if unset."""
    value = (get_env("LORA_EVICTION_POLICY") or "").strip().lower()
    if not value:
        return None
    if value not in ("lru", "cost"):
        raise ValueError(f"LORASERVE_LORA_EVICTION_POLICY must be 'lru' or 'cost', got {value!r}")
    return value


def lora_resolver_s3_cache_dir() -> str:
    """Where downloaded adapters are kept (default: <cache_root>/s3-adapters)."""
    return get_env("LORA_RESOLVER_S3_CACHE_DIR") or os.path.join(cache_root(), "s3-adapters")


def lora_resolver_s3_number(name: str, default: float, minimum: float) -> float:
    """LORA_RESOLVER_S3_<name> as a number of at least `minimum` (timeouts, retries, TTL, size bound)."""
    value = get_env(f"LORA_RESOLVER_S3_{name}")
    if value is None or not value.strip():
        return default
    try:
        number = float(value)
    except ValueError:
        number = float("nan")
    if not number >= minimum:
        raise ValueError(f"LORASERVE_LORA_RESOLVER_S3_{name} must be a number >= {minimum:g}, got {value!r}")
    return number


def http_keep_alive_timeout() -> float:
    """Seconds an idle keep-alive connection stays open (HTTP_TIMEOUT_KEEP_ALIVE, vLLM's name).

    The default, 30, is longer than vLLM's 5 on purpose: a server that closes idle connections no later
    than its clients do (httpx and the openai client expire theirs after 5 s) races them, and a request
    sent on a connection the server is closing fails with a ReadError that no log shows.
    """
    value = get_env("HTTP_TIMEOUT_KEEP_ALIVE", "30") or "30"
    try:
        seconds = float(value)
    except ValueError as exc:
        raise ValueError(
            f"LORASERVE_HTTP_TIMEOUT_KEEP_ALIVE must be a number of seconds, got {value!r}"
        ) from exc
    if not seconds > 0:
        raise ValueError(f"LORASERVE_HTTP_TIMEOUT_KEEP_ALIVE must be positive, got {value!r}")
    return seconds


def image_fetch_timeout() -> float:
    """Seconds an http(s) image URL of a request may take to download, from the request to its last
    byte (vLLM's IMAGE_FETCH_TIMEOUT, default 5); a slower one is a 400 naming the part."""
    value = get_env("IMAGE_FETCH_TIMEOUT", "5") or "5"
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not 0 < seconds < float("inf"):
        raise ValueError(f"LORASERVE_IMAGE_FETCH_TIMEOUT must be a positive number of seconds, got {value!r}")
    return seconds


def replica_stats_timeout() -> float:
    """Seconds the --replicas ingress waits for one replica's engine stats when /metrics is scraped
    (REPLICA_STATS_TIMEOUT, default 1.5); a replica slower than that is left out of the scrape."""
    value = get_env("REPLICA_STATS_TIMEOUT", "1.5") or "1.5"
    try:
        seconds = float(value)
    except ValueError:
        seconds = float("nan")
    if not seconds > 0:
        raise ValueError(
            f"LORASERVE_REPLICA_STATS_TIMEOUT must be a positive number of seconds, got {value!r}"
        )
    return seconds


def cpu_kvcache_space_bytes() -> int | None:
    """LORASERVE_CPU_KVCACHE_SPACE (vLLM's VLLM_CPU_KVCACHE_SPACE): the KV cache's size in GiB when
    --kv-cache-memory is not given; None when unset or 0 (the machine's share decides)."""
    value = get_env("CPU_KVCACHE_SPACE")
    if value is None or not value.strip():
        return None
    try:
        gib = float(value)
    except ValueError:
        gib = -1.0
    if not gib >= 0:
        raise ValueError(f"LORASERVE_CPU_KVCACHE_SPACE must be a number of GiB, got {value!r}")
    return int(gib * (1 << 30)) or None


def logging_level() -> str:
    return (get_env("LOGGING_LEVEL", "INFO") or "INFO").upper()


def cache_root() -> str:
    """Where the embedded demo model and other generated artifacts live."""
    default = os.path.join(os.path.expanduser("~"), ".cache", "loraserve")
    return get_env("CACHE_ROOT", default) or default


def gguf_dequantize() -> bool:
    """A GGUF file's quantized tensors dequantized on load into the serving dtype ("1" or "true"), as
    before weights stayed quantized; unset, the Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K linears of Llama/Qwen
    files stay in their formats (model_loader/gguf_quantized.py)."""
    return _is_true(get_env("GGUF_DEQUANTIZE"))


def cpu_packed_linear() -> bool:
    """Reorder linear weights on CPU for the C linear kernel or oneDNN (default on; "0" keeps dense
    weights and `F.linear`)."""
    return _switch("CPU_PACKED_LINEAR")


def cpu_lora_kernel() -> bool:
    """Run float32 and bfloat16 CPU LoRA through the fused C kernel (default on; "0" keeps the torch ops)."""
    return _switch("CPU_LORA_KERNEL")


def cpu_quant_act_levels() -> int:
    """LORASERVE_CPU_QUANT_ACT_LEVELS: int8 levels float32 activations take in the quantized-weight
    kernel's decode path: 1 (the default, llama.cpp's precision) or 2 (to amax / 32512 per value)."""
    value = (get_env("CPU_QUANT_ACT_LEVELS", "1") or "1").strip()
    if value not in ("1", "2"):
        raise ValueError(f"LORASERVE_CPU_QUANT_ACT_LEVELS must be 1 or 2, got {value!r}")
    return int(value)


def cpu_quant_layout() -> str:
    """LORASERVE_CPU_QUANT_LAYOUT: how GGUF-quantized weights sit in memory at one activation level:
    `panels` (the default: 8 rows interleaved, one kernel path for every row count) or `rows` (each row's
    blocks together, streamed row by row up to 32 rows of x)."""
    value = (get_env("CPU_QUANT_LAYOUT", "panels") or "panels").strip()
    if value not in ("panels", "rows"):
        raise ValueError(f"LORASERVE_CPU_QUANT_LAYOUT must be panels or rows, got {value!r}")
    return value


def cpu_kernel_arch() -> str:
    """The `-march=` the C kernels are built with (default `native`: this CPU's own instructions)."""
    return (get_env("CPU_KERNEL_ARCH", "native") or "native").strip()


def cpu_fused_ops() -> bool:
    """Run CPU RMSNorm, SiLU-and-mul and rope through the fused C kernel (default on; "0" keeps torch)."""
    return _switch("CPU_FUSED_OPS")


def cpu_huge_pages() -> bool:
    """Put packed CPU weights and LoRA slot buffers on transparent huge pages where the OS offers them
    (default on; "0" keeps plain allocations). Read when a model is packed or wrapped for LoRA."""
    return _switch("CPU_HUGE_PAGES")


def cpu_argmax_kernel() -> bool:
    """Take greedy tokens from CPU logits (float32 or bf16) with the C argmax kernel (default on; "0"
    keeps torch, on logits converted to float32). Read once, at the first greedy step."""
    return _switch("CPU_ARGMAX_KERNEL")


def cpu_gemm_kernel() -> bool:
    """Run CPU linear layers through the C kernel where it serves their dtype (default on; "0" keeps
    oneDNN's packed linear). Unset, bf16 on CPUs with AMX keeps oneDNN too (`gemm_cpu.prefers_onednn`)."""
    return _switch("CPU_GEMM_KERNEL")


def cpu_gemm_kernel_forced() -> bool:
    """LORASERVE_CPU_GEMM_KERNEL set to "1" or "true": the C linear kernel wherever it serves the dtype,
    bf16 on AMX CPUs included."""
    return _is_true(get_env("CPU_GEMM_KERNEL"))


def cpu_attention_kernel() -> bool:
    """Run CPU paged attention through the C kernel (default on; "0" keeps the torch gather + SDPA path)."""
    return _switch("CPU_ATTENTION_KERNEL")


def cpu_decoder_stack() -> bool:
    """Run a CPU step's Llama-family decoder layers as one C call where every op is a C kernel (default
    on; "0" keeps the Python loop over the same kernels). Read at every step."""
    return _switch("CPU_DECODER_STACK")


def hf_hub_offline() -> bool:
    return _is_true(os.environ.get("HF_HUB_OFFLINE")) or _is_true(os.environ.get("TRANSFORMERS_OFFLINE"))
