"""EngineArgs: the flat, user-facing engine options (Python API and CLI) turned into an EngineConfig.

This is the one list of engine options: the `serve` flags are read into it by field name, so a new
option is a field here plus a flag (with the same dest) in `entrypoints/openai/cli_args.py`.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass, fields, replace
from typing import Any

from loraserve.config import (
    CacheConfig,
    EngineConfig,
    LoRAConfig,
    ModelConfig,
    SchedulerConfig,
    resolve_device,
)


@dataclass
class EngineArgs:
    model: str
    tokenizer: str | None = None
    tokenizer_mode: str = "auto"  # "auto" | "slow"
    tokenizer_revision: str | None = None
    skip_tokenizer_init: bool = False
    hf_config_path: str | None = None
    served_model_name: str | list[str] | None = None  # a list (as --served-model-name takes): the first
    dtype: str = "auto"
    max_model_len: int | None = None
    hf_overrides: dict[str, Any] | Any | None = None  # dict or callable(PretrainedConfig) -> PretrainedConfig
    rope_scaling: dict[str, Any] | None = None  # vLLM's shortcuts for those two hf_overrides keys
    rope_theta: float | None = None
    trust_remote_code: bool = False
    model_impl: str = "auto"
    config_format: str = "auto"
    revision: str | None = None
    download_dir: str | None = None
    load_format: str = "auto"  # "auto" | "safetensors" | "pt" | "dummy" (and "gguf"/"mistral" when they fit)
    max_logprobs: int = 20
    generation_config: str = "auto"  # "auto" (the model's generation_config.json) | "vllm" (none) | a folder
    override_generation_config: dict[str, Any] | None = None
    seed: int = 0
    device: str = "auto"
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    num_kv_blocks: int | None = None
    enable_prefix_caching: bool = True
    max_num_seqs: int = 128
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    max_num_queued_reqs: int = 1024
    max_num_queued_tokens: int = 1 << 18
    max_queued_share: float = 0.5
    queue_wait_timeout_s: float = 5.0
    enable_lora: bool = False
    max_loras: int = 1
    max_cpu_loras: int | None = None
    max_lora_rank: int = 16
    lora_dtype: str = "auto"
    enable_lora_bias: bool = False
    lora_target_modules: list[str] | None = None

    def _hf_overrides(self) -> Any:
        """hf_overrides with --rope-scaling / --rope-theta folded in (a dict or JSON string only)."""
        extra = {k: v for k, v in (("rope_scaling", self.rope_scaling), ("rope_theta", self.rope_theta)) if v is not None}
        if not extra:
            return self.hf_overrides
        from loraserve.model_loader.config import parse_hf_overrides

        overrides, function = parse_hf_overrides(self.hf_overrides)
        if function is not None:
            raise ValueError("rope_scaling / rope_theta cannot be combined with a callable hf_overrides.")
        return {**overrides, **extra}

    def _check_formats(self) -> None:
        """Refuse what vLLM offers and this engine cannot do, before anything is read."""
        if self.tokenizer_mode not in ("auto", "slow"):
            raise ValueError(
                f"tokenizer_mode {self.tokenizer_mode!r} is not supported (it needs vLLM's own tokenizers); use "
                "'auto' or 'slow' (Hugging Face tokenizers)."
            )
        if self.load_format not in ("auto", "safetensors", "pt", "dummy", "gguf", "mistral"):
            raise ValueError(
                f"load_format {self.load_format!r} is not supported; use 'auto', 'safetensors', 'pt', 'dummy' "
                "(random weights), 'gguf' (a .gguf model) or 'mistral' (a params.json folder)."
            )
        if self.load_format == "gguf":
            from loraserve.model_loader.gguf import find_gguf_file

            if find_gguf_file(self.model) is None:
                raise ValueError(f"load_format 'gguf' needs a .gguf model; {self.model!r} holds none.")
        if self.max_logprobs < -1:
            raise ValueError(f"max_logprobs must be >= 0 (or -1: the vocabulary size), got {self.max_logprobs}.")

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> EngineArgs:
        """Every field that has a flag of the same dest; a flag left unset (None) keeps the default."""
        values = {f.name: getattr(args, f.name, None) for f in fields(cls)}
        return cls(**{name: value for name, value in values.items() if value is not None})

    def create_engine_config(self) -> EngineConfig:
        """Resolve the model (config, dtype, max_model_len) and build every frozen config."""
        from loraserve.config import resolve_dtype

        self._check_formats()
        device = resolve_device(self.device)
        model_config = self._model_config(device)
        lora_config = None
        if self.enable_lora:
            lora_dtype = None if self.lora_dtype == "auto" else resolve_dtype(self.lora_dtype, device)
            lora_config = LoRAConfig(
                max_loras=self.max_loras,
                max_cpu_loras=self.max_cpu_loras,
                max_lora_rank=self.max_lora_rank,
                lora_dtype=lora_dtype,
                enable_lora_bias=self.enable_lora_bias,
                target_modules=tuple(self.lora_target_modules) if self.lora_target_modules else None,
            )
        max_batched = max(self.max_num_batched_tokens, 1)
        if not self.enable_chunked_prefill:
            max_batched = max(max_batched, model_config.max_model_len)
        return EngineConfig(
            model=model_config,
            cache=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                num_blocks=self.num_kv_blocks,
                enable_prefix_caching=self.enable_prefix_caching,
            ),
            scheduler=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=max_batched,
                max_model_len=model_config.max_model_len,
                enable_chunked_prefill=self.enable_chunked_prefill,
                max_num_queued_reqs=self.max_num_queued_reqs,
                max_num_queued_tokens=self.max_num_queued_tokens,
                max_queued_share=self.max_queued_share,
                queue_wait_timeout_s=self.queue_wait_timeout_s,
            ),
            device=device,
            lora=lora_config,
        )

    def _model_config(self, device: Any) -> ModelConfig:
        """The resolved model, plus the options that need no resolving (tokenizer, logprobs, defaults)."""
        from loraserve.model_loader.config import create_model_config
        from loraserve.model_loader.generation_defaults import sampling_defaults

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
            trust_remote_code=self.trust_remote_code,
            model_impl="native" if self.model_impl == "vllm" else self.model_impl,
            config_format=self.config_format,
            revision=self.revision,
            seed=self.seed,
            hf_config_path=self.hf_config_path,
            download_dir=self.download_dir,
            load_format="auto" if self.load_format in ("gguf", "mistral") else self.load_format,
        )
        model_config = replace(
            model_config,
            tokenizer_mode=self.tokenizer_mode,
            tokenizer_revision=self.tokenizer_revision,
            skip_tokenizer_init=self.skip_tokenizer_init,
            max_logprobs=self.max_logprobs,
            sampling_defaults=sampling_defaults(
                model_config.model_path, self.generation_config, self.override_generation_config
            ),
        )
        if self.load_format == "mistral" and model_config.config_format != "mistral":
            raise ValueError("load_format 'mistral' reads consolidated*.safetensors, which needs a Mistral-format "
                             "folder (params.json); this model is in the Hugging Face format.")
        return model_config
