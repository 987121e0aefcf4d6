"""Engine configuration: frozen dataclasses built once from user arguments, read everywhere else."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

_DTYPE_NAMES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp16": torch.float16,
}


def cpu_has_native_bf16() -> bool:
    """True when this CPU computes bf16 matmuls in hardware (AVX512-BF16 or AMX)."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            flags = f.read()
    except OSError:
        return False
    return "avx512_bf16" in flags or "amx_bf16" in flags


def resolve_device(device: str | None) -> torch.device:
    """'auto'/None picks CUDA when present, else CPU; anything else is taken as given."""
    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config_dtype: Any = None) -> torch.dtype:
    """Map the user's dtype to a torch dtype.

    "auto" on CPU is bf16 where the CPU has native bf16 (where it is 2-3x faster than fp32) and
    float32 elsewhere (emulated bf16 is ~3.5x slower than fp32 on AVX2-only CPUs). On CUDA it is the
    checkpoint's dtype, with float32 checkpoints served in bf16.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    name = str(dtype).lower()
    if name != "auto":
        if name not in _DTYPE_NAMES:
            raise ValueError(f"Unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16.")
        return _DTYPE_NAMES[name]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if isinstance(config_dtype, str):
        config_dtype = _DTYPE_NAMES.get(config_dtype.replace("torch.", ""))
    if config_dtype in (torch.float16, torch.bfloat16):
        return config_dtype
    return torch.bfloat16


@dataclass(frozen=True, eq=False)
class ModelConfig:
    """What model to run and how: resolved once by `model_loader.config.create_model_config`."""

    model: str  # as the user named it (repo id or folder)
    model_path: str  # local folder holding the files
    hf_config: Any  # transformers.PretrainedConfig after hf_overrides
    architectures: tuple[str, ...]
    dtype: torch.dtype
    max_model_len: int
    model_impl: str = "auto"  # "auto" | "native" | "transformers"
    trust_remote_code: bool = False
    tokenizer: str = ""
    seed: int = 0
    config_format: str = "hf"  # "hf" | "mistral"
    served_model_name: str = ""
    tokenizer_mode: str = "auto"  # "auto" (fast when there is one) | "slow"
    tokenizer_revision: str | None = None
    skip_tokenizer_init: bool = False  # no tokenizer: token-id prompts only, outputs without text
    load_format: str = "auto"  # "auto" | "safetensors" | "pt" | "dummy" (random weights)
    max_logprobs: int = 20  # most logprobs (sample or prompt) a request may ask for
    # Sampling defaults for requests that leave a field unset (generation_config.json, vLLM's "auto").
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)


@dataclass(frozen=True)
class CacheConfig:
    """Paged KV cache: block size and the memory budget that sets the number of blocks."""

    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_blocks: int | None = None  # overrides the memory budget when set (tests force preemption)
    enable_prefix_caching: bool = True


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits for one engine step."""

    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    enable_chunked_prefill: bool = True
    # Admission control (vLLM's names): sequences in flight (waiting + running; n counts n times), and
    # prompt tokens still to prefill. A request beyond either limit now waits nowhere: it gets a 503.
    max_num_queued_reqs: int = 1024
    max_num_queued_tokens: int = 1 << 18
    # Fair admission (loraserve's own; vLLM has none): one request, and one API key's requests
    # together, may hold at most this fraction of each queue limit, so one client never fills the queue.
    max_queued_share: float = 0.5
    # A request that finds the queue full waits this long for room, in a fair order by client, before
    # its 503 (0: at once), so a big request is not turned away forever by a stream of small ones.
    queue_wait_timeout_s: float = 5.0

    def __post_init__(self) -> None:
        if not 0 < self.max_queued_share <= 1:
            raise ValueError(f"max_queued_share must be in (0, 1], got {self.max_queued_share}.")
        if not 0 <= self.queue_wait_timeout_s < float("inf"):
            raise ValueError(
                f"queue_wait_timeout_s must be a finite number >= 0, got {self.queue_wait_timeout_s}."
            )


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA limits: compute slots, host cache size, buffer rank and dtype."""

    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    lora_dtype: torch.dtype | None = None  # None = model dtype
    enable_lora_bias: bool = False
    # vLLM's --lora-target-modules: LoRA only on these module names (e.g. ("o_proj", "qkv_proj")); an
    # adapter's weights for other modules are skipped with a warning. None: every LoRA-capable module.
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        if self.max_loras < 1:
            raise ValueError(f"max_loras must be >= 1, got {self.max_loras}.")
        if self.max_lora_rank < 1:
            raise ValueError(f"max_lora_rank must be >= 1, got {self.max_lora_rank}.")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.max_loras:
            raise ValueError(
                f"max_cpu_loras ({self.max_cpu_loras}) must be >= max_loras ({self.max_loras})."
            )

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, in one value passed down explicitly."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: torch.device
    lora: LoRAConfig | None = None
