"""EngineArgs: the flat, user-facing engine options (Python API and CLI) turned into an EngineConfig.

Each engine option is declared once, as a field (`loraserve.options.option`: default, help, flag,
check): here when its config value is resolved from it (dtype, max_model_len, lora_dtype, ...), else
on the config that keeps it (`loraserve/config.py`), whose option fields `shares_options` adds here.
The `serve` flags are generated from these fields, `LLM(**kwargs)` takes them, and their checks run
when an EngineArgs is built (after the demo's defaults), so a bad value fails before anything loads.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import Any

from loraserve.config import (
    DTYPE_CHOICES,
    STRUCTURED_OUTPUT_BACKENDS,
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    StructuredOutputsConfig,
    resolve_device,
)
from loraserve.option_types import json_object, json_value, positive_int, positive_seconds
from loraserve.options import at_least, check_options, declared_options, option, shares_options
from loraserve.speculative_config import SpeculativeConfig, check_speculative_options

_LOADING = "model loading, tokenizer and sampling defaults"
_LOAD_FORMATS = ("auto", "safetensors", "pt", "dummy", "gguf", "mistral")


def _structured_outputs_config(config: dict[str, Any]) -> str | None:
    try:
        StructuredOutputsConfig.from_options(config, None)
    except (TypeError, ValueError) as exc:
        return f"is not valid: {exc}"
    return None


def _finite_positive(seconds: float) -> str | None:
    return None if 0 < seconds < float("inf") else f"must be a finite number > 0, got {seconds}."


def _served_backend(backend: str) -> str | None:
    try:
        StructuredOutputsConfig(backend=backend)
    except ValueError as exc:
        return f"is not valid: {exc}"
    return None


def _known_load_format(load_format: str) -> str | None:
    if load_format in _LOAD_FORMATS:
        return None
    return (
        f"{load_format!r} is not supported; use 'auto', 'safetensors', 'pt', 'dummy' (random weights), "
        "'gguf' (a .gguf model) or 'mistral' (a params.json folder)."
    )


@dataclass
@shares_options(ModelConfig, CacheConfig, SchedulerConfig, LoRAConfig)
class EngineArgs:
    model: str = option(flag="", help="Model folder or Hugging Face repo id.")
    tokenizer: str | None = option(
        None,
        group="model",
        help="Tokenizer folder or hub id (default: the model's; for GGUF, the one in its metadata).",
    )
    hf_config_path: str | None = option(
        None,
        group="model",
        help="config.json (or its folder) to use for a GGUF model instead of the file's metadata.",
    )
    # A list (as --served-model-name takes): the engine reports the first; the server answers to all.
    served_model_name: str | list[str] | None = option(
        None,
        nargs="+",
        group="server",
        help="Name(s) clients use in the 'model' field (default: MODEL as given). The first one is reported.",
    )
    dtype: str = option(
        "auto",
        choices=DTYPE_CHOICES,
        group="model",
        help="Weight and activation dtype (default: auto = the checkpoint's, fp32 on CPUs without bf16).",
    )
    max_model_len: int | None = option(
        None,
        type=positive_int,
        group="model",
        help="Longest prompt + completion in tokens, e.g. 2048 or 4k (default: from the config).",
    )
    structured_outputs_config: dict[str, Any] | None = option(
        None,
        type=json_object,
        group="structured outputs",
        check=_structured_outputs_config,
        help="JSON object, vLLM's StructuredOutputsConfig: backend ('auto' or 'xgrammar'), "
        "disable_any_whitespace, disable_additional_properties, disable_fallback.",
    )
    guided_decoding_backend: str | None = option(
        None,
        choices=STRUCTURED_OUTPUT_BACKENDS,
        group="structured outputs",
        check=_served_backend,
        help="vLLM's older name for structured_outputs_config's backend ('auto' or 'xgrammar' here).",
    )
    structured_outputs_compile_timeout: float = option(
        10.0,
        type=positive_seconds,
        group="structured outputs",
        check=_finite_positive,
        help="loraserve only: seconds one grammar (JSON schema, regex, EBNF, structural tag, tool "
        "schemas) may take to compile on the server; past it the compile is killed and the request "
        "gets a 400 naming its field (default: 10).",
    )
    structured_outputs_compile_workers: int = option(
        2,
        type=positive_int,
        group="structured outputs",
        check=at_least(1),
        help="loraserve only: worker processes compiling grammars for the server; one client's "
        "compiles hold at most --max-queued-share of them at once (default: 2).",
    )
    # A dict or callable(PretrainedConfig) -> PretrainedConfig.
    hf_overrides: dict[str, Any] | Any | None = option(
        None,
        type=json_object,
        group="model",
        help="JSON object of model config overrides, e.g. '{\"rope_theta\": 20000}'.",
    )
    # vLLM's shortcuts for those two hf_overrides keys.
    rope_scaling: dict[str, Any] | None = option(
        None, type=json_value, group=_LOADING, help="JSON rope_scaling for the config."
    )
    rope_theta: float | None = option(None, type=float, group=_LOADING, help="rope_theta for the config.")
    model_impl: str = option(
        "auto",
        choices=("auto", "native", "vllm", "transformers"),
        group="model",
        help="auto: native implementation when there is one (vllm = native), else the transformers fallback.",
    )
    config_format: str = option(
        "auto",
        choices=("auto", "hf", "mistral"),
        group=_LOADING,
        help="auto: params.json (Mistral) when present, else config.json.",
    )
    revision: str | None = option(
        None, group=_LOADING, help="Model revision on the Hub (branch, tag or commit)."
    )
    download_dir: str | None = option(None, group=_LOADING, help="Hugging Face cache folder for downloads.")
    load_format: str = option(
        "auto",
        choices=_LOAD_FORMATS,
        check=_known_load_format,
        group=_LOADING,
        help="Which weight files to read; dummy = random weights (profiling).",
    )
    # "auto" (the model's generation_config.json) | "vllm" (none) | a folder.
    generation_config: str = option(
        "auto",
        group=_LOADING,
        help="Sampling defaults: auto (the model's generation_config.json, default), vllm (none) or a folder.",
    )
    override_generation_config: dict[str, Any] | None = option(
        None, type=json_value, group=_LOADING, help="JSON sampling defaults, e.g. '{\"temperature\": 0.5}'."
    )
    device: str = option("auto", group="model", help="auto, cpu, cuda or cuda:N (default: auto).")
    num_kv_blocks: int | None = option(
        None,
        flag="--num-gpu-blocks-override",
        type=int,
        group=_LOADING,
        help="Exact number of KV-cache blocks (overrides the memory budget).",
    )
    enable_lora: bool = option(False, action="bool", group="LoRA", help="Serve LoRA adapters.")
    lora_dtype: str = option(
        "auto",
        choices=DTYPE_CHOICES,
        group="LoRA",
        help="Adapter weight dtype (default: auto = the model's).",
    )
    lora_target_modules: list[str] | None = option(
        None,
        nargs="+",
        metavar="MODULE",
        group="LoRA",
        help="Put LoRA only on these modules (e.g. o_proj qkv_proj); adapters' weights for others are "
        "skipped with a warning (default: every LoRA-capable module).",
    )

    speculative_config: dict[str, Any] | None = option(
        None,
        type=json_object,
        group="speculative decoding",
        check=check_speculative_options,
        help='JSON object, vLLM\'s: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_min": A, '
        '"prompt_lookup_max": B} or {"model": DRAFT, "num_speculative_tokens": K}; also disable_by_batch_size, '
        "loraserve's draft_lora_modules ({adapter: draft adapter path}) and draft_policy (adaptive, always). "
        "See docs/speculative-decoding.md.",
    )

    def __post_init__(self) -> None:
        check_options(self)

    def _hf_overrides(self) -> Any:
        """hf_overrides with --rope-scaling / --rope-theta folded in (a dict or JSON string only)."""
        extra = {
            k: v
            for k, v in (("rope_scaling", self.rope_scaling), ("rope_theta", self.rope_theta))
            if v is not None
        }
        if not extra:
            return self.hf_overrides
        from loraserve.model_loader.config import parse_hf_overrides

        overrides, function = parse_hf_overrides(self.hf_overrides)
        if function is not None:
            raise ValueError("rope_scaling / rope_theta cannot be combined with a callable hf_overrides.")
        return {**overrides, **extra}

    def _check_formats(self, device: Any) -> None:
        """What needs the file system or the device to check (the option fields checked their values)."""
        from loraserve.config import INT8_QUANTIZATIONS

        method = self._shared(ModelConfig)["quantization"]  # a ModelConfig option, shared here
        if self.load_format != "gguf" and method not in ("gguf", *INT8_QUANTIZATIONS):
            return
        from loraserve.model_loader.gguf import find_gguf_file

        is_gguf = find_gguf_file(self.model) is not None
        if self.load_format == "gguf" and not is_gguf:
            raise ValueError(f"load_format 'gguf' needs a .gguf model; {self.model!r} holds none.")
        if method == "gguf" and not is_gguf:
            raise ValueError(f"quantization 'gguf' needs a .gguf model; {self.model!r} holds none.")
        if method in INT8_QUANTIZATIONS:
            where = "" if device.type == "cpu" else f" (the quantized kernels run on CPUs, not {device.type})"
            if is_gguf:
                where = " (a GGUF file is served in its own formats: leave --quantization unset or 'gguf')"
            elif self.load_format == "dummy":
                where = " (load_format 'dummy' has no checkpoint weights to quantize)"
            if where:
                raise ValueError(f"quantization {method!r} quantizes a float checkpoint on load{where}.")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Every field, read by its flag's dest (the field name); a flag left unset (None) keeps the
        default. `model` is the positional MODEL or --model."""
        values = {f.name: getattr(args, f.name, None) for f in fields(cls)}
        return cls(**{name: value for name, value in values.items() if value is not None})

    @classmethod
    def from_kwargs(cls, model: str, kwargs: dict[str, Any]) -> EngineArgs:
        """`LLM(model, **kwargs)`: exactly the option fields; anything else is a TypeError naming it."""
        names = {f.name for f, _ in declared_options(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(f"unexpected keyword argument(s) for the engine: {', '.join(unknown)}")
        return cls(model=model, **kwargs)

    def _shared(self, config: type) -> dict[str, Any]:
        """This object's values of `config`'s option fields (which `shares_options` gave it)."""
        return {f.name: getattr(self, f.name) for f, _ in declared_options(config)}

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model (config, dtype, max_model_len) and build every frozen config."""
        from loraserve.config import resolve_dtype

        device = resolve_device(self.device)
        self._check_formats(device)
        model_config = self._model_config(device)
        lora_config = None
        if self.enable_lora:
            lora_dtype = None if self.lora_dtype == "auto" else resolve_dtype(self.lora_dtype, device)
            target_modules = tuple(self.lora_target_modules) if self.lora_target_modules else None
            lora_config = LoRAConfig(
                **self._shared(LoRAConfig), lora_dtype=lora_dtype, target_modules=target_modules
            )
        scheduler = self._shared(SchedulerConfig)
        max_batched = max(scheduler["max_num_batched_tokens"], 1)
        if not scheduler["enable_chunked_prefill"]:
            max_batched = max(max_batched, model_config.max_model_len)
        scheduler.update(max_num_batched_tokens=max_batched, max_model_len=model_config.max_model_len)
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(**self._shared(CacheConfig), num_blocks=self.num_kv_blocks),
            scheduler=SchedulerConfig(**scheduler),
            device=device,
            lora=lora_config,
            structured_outputs=StructuredOutputsConfig.from_options(
                self.structured_outputs_config, self.guided_decoding_backend
            ),
            speculative=SpeculativeConfig.from_options(self.speculative_config)
            if self.speculative_config is not None
            else None,
        )

    def _model_config(self, device: Any) -> ModelConfig:
        """The resolved model, plus the options that need no resolving (tokenizer, logprobs, defaults)."""
        from loraserve.model_loader.config import create_model_config
        from loraserve.model_loader.generation_defaults import sampling_defaults

        shared = self._shared(ModelConfig)
        served_model_name = self.served_model_name
        if isinstance(served_model_name, list):
            served_model_name = served_model_name[0] if served_model_name else None
        model_config = create_model_config(
            self.model,
            tokenizer=self.tokenizer,
            served_model_name=served_model_name,
            dtype=self.dtype,
            device=device,
            max_model_len=self.max_model_len,
            hf_overrides=self._hf_overrides(),
            trust_remote_code=shared.pop("trust_remote_code"),
            model_impl="native" if self.model_impl == "vllm" else self.model_impl,
            config_format=self.config_format,
            revision=self.revision,
            seed=shared.pop("seed"),
            hf_config_path=self.hf_config_path,
            download_dir=self.download_dir,
            load_format="auto" if self.load_format in ("gguf", "mistral") else self.load_format,
        )
        model_config = replace(
            model_config,
            **shared,
            sampling_defaults=sampling_defaults(
                model_config.model_path, self.generation_config, self.override_generation_config
            ),
        )
        if self.load_format == "mistral" and model_config.config_format != "mistral":
            raise ValueError(
                "load_format 'mistral' reads consolidated*.safetensors, which needs a Mistral-format "
                "folder (params.json); this model is in the Hugging Face format."
            )
        return model_config
