"""Engine configuration: frozen dataclasses built once from user arguments, read everywhere else.

The fields users set are declared here once, with `loraserve.options.option` (default, help, flag,
check); EngineArgs and the `serve` flags take them from these fields. `CacheConfig` is declared in
`cache_config.py` (with what the KV-cache dtypes mean) and is importable from here. Torch is imported
only where a dtype or device is resolved, so that flag parsing never waits for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from loraserve import envs
from loraserve.cache_config import CACHE_GROUP, CacheConfig
from loraserve.multimodal_config import MultiModalConfig
from loraserve.option_types import non_negative_seconds, positive_int, queue_share
from loraserve.options import at_least, check_options, option
from loraserve.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    import torch

DTYPE_CHOICES = ("auto", "float32", "float", "fp32", "bfloat16", "bf16", "float16", "half", "fp16")


def _dtype_names() -> dict[str, torch.dtype]:
    import torch

    names = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    aliases = dict(float="float32", fp32="float32", bf16="bfloat16", half="float16", fp16="float16")
    return names | {alias: names[name] for alias, name in aliases.items()}


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
    import torch

    if device in (None, "auto"):
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device, config_dtype: Any = None) -> torch.dtype:
    """Map the user's dtype to a torch dtype.

    "auto" on CPU is bf16 where the CPU has native bf16 (where it is 2-3x faster than fp32) and
    float32 elsewhere (emulated bf16 is ~3.5x slower than fp32 on AVX2-only CPUs). On CUDA it is the
    checkpoint's dtype, with float32 checkpoints served in bf16.
    """
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    names = _dtype_names()
    name = str(dtype).lower()
    if name != "auto":
        if name not in names:
            raise ValueError(f"Unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16.")
        return names[name]
    if device.type == "cpu":
        return torch.bfloat16 if cpu_has_native_bf16() else torch.float32
    if isinstance(config_dtype, str):
        config_dtype = names.get(config_dtype.replace("torch.", ""))
    if config_dtype in (torch.float16, torch.bfloat16):
        return config_dtype
    return torch.bfloat16


_LOADING = "model loading, tokenizer and sampling defaults"


def _hf_tokenizer_mode(mode: str) -> str | None:
    if mode in ("auto", "slow"):
        return None
    return f"{mode!r} is not supported (it needs vLLM's own tokenizers); use 'auto' or 'slow' (Hugging Face tokenizers)."


# --quantization values served: on-load int8 under vLLM's names whose meaning is that (int8 weights
# of a float checkpoint, quantized as it loads: "tpu_int8", "rtn" at its default 8 bits) and "gguf",
# a GGUF file's own blocks. vLLM's other methods read checkpoints quantized offline (AWQ, GPTQ, ...) or
# quantize to formats the CPU kernels do not run (fp8, nvfp4), so they are refused by name.
INT8_QUANTIZATIONS = ("int8", "tpu_int8", "rtn")
QUANTIZATIONS = (*INT8_QUANTIZATIONS, "gguf")


def _served_quantization(method: str | None) -> str | None:
    if method is None or method in QUANTIZATIONS:
        return None
    return (
        f"{method!r} is not served; loraserve quantizes a float checkpoint on load to int8 "
        "('int8', or vLLM's 'tpu_int8' and 'rtn': per-32-weight int8 blocks, GGUF's Q8_0) and serves a "
        "GGUF file's own blocks ('gguf')."
    )


def _logprobs_limit(limit: int) -> str | None:
    return None if limit >= -1 else f"must be >= 0 (or -1: the vocabulary size), got {limit}."


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
    trust_remote_code: bool = option(
        False, action="store_true", group="model", help="Allow custom code from the model repo."
    )
    tokenizer: str = ""
    seed: int = option(0, type=int, group="model", help="Random seed for sampling (default: 0).")
    config_format: str = "hf"  # "hf" | "mistral"
    served_model_name: str = ""
    tokenizer_mode: str = option(
        "auto",
        choices=("auto", "slow"),
        check=_hf_tokenizer_mode,
        group=_LOADING,
        help="auto: the fast tokenizer when there is one.",
    )
    tokenizer_revision: str | None = option(None, group=_LOADING, help="Tokenizer revision on the Hub.")
    skip_tokenizer_init: bool = option(
        False,
        action="bool",
        group=_LOADING,
        help="No tokenizer: prompts must be token ids, completions carry no text.",
    )
    load_format: str = "auto"  # "auto" | "safetensors" | "pt" | "dummy" (random weights)
    quantization: str | None = option(
        None,
        flag=("--quantization", "-q"),
        metavar="METHOD",
        check=_served_quantization,
        group=_LOADING,
        help="int8 (or vLLM's tpu_int8, rtn): quantize a float checkpoint's linear weights on load to "
        "int8 blocks of 32 (Q8_0), run by the CPU's quantized kernels; gguf: a GGUF file's own blocks "
        "(its default). Default: none (a GGUF file's blocks are still kept).",
    )
    max_logprobs: int = option(
        20,
        type=int,
        check=_logprobs_limit,
        group=_LOADING,
        help="Most logprobs a request may ask for (default: 20; -1: the vocabulary size).",
    )
    # Sampling defaults for requests that leave a field unset (generation_config.json, vLLM's "auto").
    sampling_defaults: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def vocab_size(self) -> int:
        config = self.hf_config
        if getattr(config, "vocab_size", None) is None and hasattr(config, "get_text_config"):
            config = config.get_text_config()  # a multimodal config keeps it in its text config
        return int(config.vocab_size)


_LIMITS = "limits and shutdown"


def _a_queue_share(share: float) -> str | None:
    return None if 0 < share <= 1 else f"must be in (0, 1], got {share}."


def _finite_seconds(seconds: float) -> str | None:
    return None if 0 <= seconds < float("inf") else f"must be a finite number >= 0, got {seconds}."


@dataclass(frozen=True)
class SchedulerConfig:
    """Continuous-batching limits for one engine step."""

    max_num_seqs: int = option(
        128, type=positive_int, group=CACHE_GROUP, help="Most sequences in one batch (default: %(default)s)."
    )
    max_num_batched_tokens: int = option(
        2048,
        type=positive_int,
        group=CACHE_GROUP,
        help="Most tokens processed in one engine step, prefill chunks included (default: %(default)s).",
    )
    max_num_seqs_share: float = option(
        0.5,
        type=queue_share,
        group=CACHE_GROUP,
        help="loraserve only: the fraction of --max-num-seqs one request's sequences (n, best_of, beams, "
        "prompts) may hold while others wait for a slot; 1.0 is vLLM's behaviour (default: 0.5).",
        check=_a_queue_share,
    )
    max_model_len: int = 2048  # resolved from the model (EngineArgs.max_model_len)
    scheduling_policy: str = option(
        "fcfs",
        choices=("fcfs", "priority"),
        group=CACHE_GROUP,
        help="fcfs: arrival order, requests taking turns; priority: lower `priority` first (then arrival), "
        "the same turns within a level (default: fcfs).",
    )
    enable_chunked_prefill: bool = option(
        True, action="bool", group="model", help="Split long prompts across steps (default: on)."
    )
    # Admission control (vLLM's names): sequences in flight (waiting + running; n counts n times), and
    # prompt tokens still to prefill. A request beyond either limit now waits nowhere: it gets a 503.
    max_num_queued_reqs: int = option(
        1024,
        type=positive_int,
        group=_LIMITS,
        help="Most sequences waiting or running at once (a request with n choices counts n); beyond it "
        "requests get 503 with Retry-After, and a request larger than it alone gets 400 (default: 1024).",
    )
    max_num_queued_tokens: int = option(
        1 << 18,
        type=positive_int,
        group=_LIMITS,
        help="Most prompt tokens waiting to be processed, e.g. 256k; beyond it requests get 503 with "
        "Retry-After (default: 262144).",
    )

    max_queued_share: float = option(
        0.5,
        type=queue_share,
        group=_LIMITS,
        help="loraserve only: the fraction (0 < f <= 1) of each queue limit that one request, and all the "
        "requests of one API key together, may hold; a request larger than its share gets 400, so one "
        "client never fills the queue for everyone (default: 0.5).",
        check=_a_queue_share,
    )
    queue_wait_timeout_s: float = option(
        5.0,
        flag="--queue-wait-timeout",
        type=non_negative_seconds,
        group=_LIMITS,
        help="loraserve only: seconds a request that finds the queue full waits for room (in turn, "
        "round-robin by API key) before its 503; 0 answers 503 at once (default: 5).",
        check=_finite_seconds,
    )


def _cpu_loras_hold_the_batch(config: Any) -> str | None:
    if config.max_cpu_loras is not None and config.max_cpu_loras < config.max_loras:
        return f"max_cpu_loras ({config.max_cpu_loras}) must be >= max_loras ({config.max_loras})."
    return None


@dataclass(frozen=True)
class LoRAConfig:
    """Multi-LoRA limits: compute slots, host cache size, buffer rank and dtype."""

    __option_checks__ = (_cpu_loras_hold_the_batch,)

    max_loras: int = option(
        1,
        type=positive_int,
        check=at_least(1),
        group="LoRA",
        help="Adapters usable in one batch (default: 1; for the demo model, all of its adapters).",
    )
    max_cpu_loras: int | None = option(
        None, type=positive_int, group="LoRA", help="Adapters kept in host memory (default: --max-loras)."
    )
    max_lora_rank: int = option(
        16,
        type=positive_int,
        check=at_least(1),
        group="LoRA",
        help="Largest adapter rank accepted (default: %(default)s).",
    )
    lora_dtype: torch.dtype | None = None  # None = model dtype (EngineArgs.lora_dtype)
    enable_lora_bias: bool = option(
        False, action="store_true", group="LoRA", help="Accept adapters with bias terms."
    )
    enable_tower_connector_lora: bool = option(False, action="bool", group="LoRA", help=(
        "Vision-language models: LoRA on the vision tower and connector too (else skipped, vLLM's rule)."))  # fmt: skip
    lora_eviction_policy: str | None = option(
        None,
        choices=("lru", "cost"),
        group="LoRA",
        help="loraserve only: how the host cache picks the adapter to evict: 'cost' weighs recency and "
        "frequency by each adapter's expected reload time (its size, its source's measured speed), "
        "'lru' the least recently requested; either keeps the adapters queued requests need (default: "
        "$LORASERVE_LORA_EVICTION_POLICY, else cost).",
    )
    # vLLM's --lora-target-modules: LoRA only on these module names (e.g. ("o_proj", "qkv_proj")); an
    # adapter's weights for other modules are skipped with a warning. None: every LoRA-capable module.
    target_modules: tuple[str, ...] | None = None

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def cpu_capacity(self) -> int:
        return self.max_cpu_loras if self.max_cpu_loras is not None else self.max_loras

    @property
    def eviction_policy(self) -> str:
        """The host cache's eviction policy: the option, else LORASERVE_LORA_EVICTION_POLICY, else "cost"."""
        return self.lora_eviction_policy or envs.lora_eviction_policy() or "cost"


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance", "outlines", "lm-format-enforcer")
SERVED_STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """vLLM's StructuredOutputsConfig (--structured-outputs-config): the grammar backend and the JSON
    whitespace rule. Only xgrammar is served ("auto" picks it); `disable_fallback` has nothing to
    disable, and `disable_additional_properties` is what xgrammar does anyway (schemas compile strictly)."""

    backend: str = "auto"
    disable_fallback: bool = False
    disable_any_whitespace: bool = False
    disable_additional_properties: bool = False
    reasoning_parser: str = ""
    enable_in_reasoning: bool = False

    def __post_init__(self) -> None:
        if self.backend not in SERVED_STRUCTURED_OUTPUT_BACKENDS:
            known = "" if self.backend in STRUCTURED_OUTPUT_BACKENDS else " (unknown backend)"
            raise ValueError(
                f"structured outputs backend {self.backend!r}{known} is not available here; this server "
                "serves 'xgrammar' ('auto' picks it)."
            )
        if self.reasoning_parser or self.enable_in_reasoning:
            raise ValueError(
                "structured outputs within reasoning need a reasoning parser, which is not supported."
            )

    @classmethod
    def from_options(
        cls, config: Mapping[str, Any] | None, guided_decoding_backend: str | None
    ) -> StructuredOutputsConfig:
        """From --structured-outputs-config (a JSON object) and the older --guided-decoding-backend."""
        values = dict(config or {})
        unknown = sorted(set(values) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"structured_outputs_config has unknown field(s): {', '.join(unknown)}.")
        if guided_decoding_backend is not None:
            values.setdefault("backend", guided_decoding_backend)
        return cls(**values)


@dataclass(frozen=True)
class EngineConfig:
    """Everything the engine needs, in one value passed down explicitly."""

    model: ModelConfig
    cache: CacheConfig
    scheduler: SchedulerConfig
    device: torch.device
    lora: LoRAConfig | None = None
    structured_outputs: StructuredOutputsConfig = field(default_factory=StructuredOutputsConfig)
    multimodal: MultiModalConfig = field(default_factory=MultiModalConfig)
    speculative: SpeculativeConfig | None = None
