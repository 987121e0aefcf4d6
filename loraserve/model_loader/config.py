"""Model config resolution: where the model lives, which format it is, its HF config and the ModelConfig.

Order of operations (the same as vLLM's, so its fixes work here): find the files (local folder or
hub snapshot), detect the format (`params.json` = Mistral, else `config.json` = HF), apply a
`model_type` override before the config class is chosen, parse, apply the other `hf_overrides`, fill
a missing `architectures` from transformers' model_type -> causal-LM mapping, then validate that an
implementation exists before any weight is read.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable
from typing import Any

import torch

from loraserve import envs
from loraserve.config import ModelConfig, resolve_device, resolve_dtype
from loraserve.model_loader import mistral
from loraserve.model_loader.gguf import find_gguf_file, gguf_folder
from loraserve.model_loader.weights import download_weights, hub_snapshot

logger = logging.getLogger(__name__)

HF_CONFIG_FILE = "config.json"
CONFIG_FORMATS = ("auto", "hf", "mistral")
# Files needed before weights: configs, tokenizer files and any remote code the config refers to.
METADATA_PATTERNS = ["*.json", "*.model", "*.model.v*", "*.txt", "*.tiktoken", "*.jinja", "*.py"]
_MAX_LEN_KEYS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
    "model_max_length",
)
_DEFAULT_MAX_MODEL_LEN = 2048
HfOverrides = dict[str, Any] | Callable[[Any], Any] | str | None


def parse_hf_overrides(hf_overrides: HfOverrides) -> tuple[dict[str, Any], Callable[[Any], Any] | None]:
    """Split `hf_overrides` into (dict of top-level keys, callable); a JSON string is decoded first."""
    if hf_overrides is None or hf_overrides == "":
        return {}, None
    if isinstance(hf_overrides, str):
        try:
            hf_overrides = json.loads(hf_overrides)
        except json.JSONDecodeError as e:
            raise ValueError(f"hf_overrides is not valid JSON ({e}): {hf_overrides!r}") from e
        if not isinstance(hf_overrides, dict):
            raise ValueError(
                f'hf_overrides must be a JSON object such as \'{{"architectures": ["LlamaForCausalLM"]}}\', '
                f"got {type(hf_overrides).__name__}: {hf_overrides!r}"
            )
    if isinstance(hf_overrides, dict):
        return dict(hf_overrides), None
    if callable(hf_overrides):
        return {}, hf_overrides
    raise ValueError(
        f"hf_overrides must be a dict, a JSON object string or a callable, got {type(hf_overrides).__name__}."
    )


def resolve_model_path(model: str, revision: str | None = None, cache_dir: str | None = None) -> str:
    """A local folder as given, else the hub snapshot (configs and tokenizer only; weights come later)."""
    local = os.path.expanduser(model)
    if os.path.isdir(local):
        return os.path.abspath(local)
    if local.startswith(("/", "./", "../", "~")) or os.path.exists(local):
        raise ValueError(f"model {model!r} looks like a local path but is not an existing folder.")
    return hub_snapshot(model, revision, METADATA_PATTERNS, cache_dir=cache_dir)


def detect_config_format(model_path: str, config_format: str, model: str) -> str:
    """'mistral' when params.json exists (auto), else 'hf' when config.json exists; else a clear error."""
    if config_format not in CONFIG_FORMATS:
        raise ValueError(f"config_format must be one of {list(CONFIG_FORMATS)}, got {config_format!r}.")
    has_params = os.path.isfile(os.path.join(model_path, mistral.PARAMS_FILE))
    has_hf = os.path.isfile(os.path.join(model_path, HF_CONFIG_FILE))
    if config_format == "auto" and (has_params or has_hf):
        return "mistral" if has_params else "hf"
    if config_format == "mistral" and has_params:
        return "mistral"
    if config_format == "hf" and has_hf:
        return "hf"
    looked_for = {
        "auto": "params.json (Mistral format) and config.json (Hugging Face format)",
        "mistral": "params.json (Mistral format)",
        "hf": "config.json (Hugging Face format)",
    }
    raise ValueError(
        f"No model config found for model {model!r} (config_format={config_format!r}): looked for "
        f"{looked_for[config_format]} in {model_path}. Expected a Hugging Face repo id or a local folder "
        "containing config.json or params.json."
    )


def _overridden_model_type(model_type: Any, overrides_kw: dict[str, Any], overrides_fn: Any) -> Any:
    """model_type after overrides; the callable is probed on a blank config to see whether it changes it."""
    if "model_type" in overrides_kw:
        return overrides_kw["model_type"]
    if overrides_fn is None:
        return model_type
    from transformers import PretrainedConfig

    probe = PretrainedConfig()
    setattr(probe, "model_type", model_type or "")  # noqa: B010 (an instance value over the class default)
    try:
        probed = overrides_fn(probe)
    except Exception as e:  # a callable written for the real config may fail on the blank probe
        logger.debug("hf_overrides callable failed on the model_type probe (%s); model_type unchanged", e)
        return model_type
    new_type = getattr(probed, "model_type", None)
    return new_type if new_type and new_type != (model_type or "") else model_type


def _remote_code_error(model: str, detail: str) -> ValueError:
    return ValueError(
        f"The config of model {model!r} requires running the repository's own code ({detail}). If you trust "
        "it, pass trust_remote_code=True (CLI: --trust-remote-code)."
    )


def _rename_su_rope(raw: dict[str, Any]) -> None:
    """Early Phi-3 configs name LongRoPE "su"; transformers renames it only after checking the
    LongRoPE fields, which then miss `original_max_position_embeddings` and fail, so rename first."""
    scaling = raw.get("rope_scaling")
    if isinstance(scaling, dict) and "su" in (scaling.get("type"), scaling.get("rope_type")):
        raw["rope_scaling"] = {**scaling, "type": "longrope"} | (
            {"rope_type": "longrope"} if "rope_type" in scaling else {}
        )


def _parse_hf_config(
    model: str, model_path: str, overrides_kw: dict[str, Any], overrides_fn: Any, trust_remote_code: bool
) -> Any:
    import transformers
    from transformers import AutoConfig, PretrainedConfig
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    path = os.path.join(model_path, HF_CONFIG_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            raw = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    model_type = _overridden_model_type(raw.get("model_type"), overrides_kw, overrides_fn)
    is_type_overridden = model_type != raw.get("model_type")
    raw.update(overrides_kw)
    _rename_su_rope(raw)
    if model_type:
        raw["model_type"] = model_type
    auto_map = raw.get("auto_map") or {}
    # Trusted remote code wins, as in transformers, unless the user re-typed the model explicitly.
    if "AutoConfig" in auto_map and trust_remote_code and not is_type_overridden:
        config = AutoConfig.from_pretrained(model_path, trust_remote_code=True)
        config.update({k: v for k, v in overrides_kw.items() if k != "model_type"})
        return config
    if model_type in CONFIG_MAPPING:
        return CONFIG_MAPPING[model_type].from_dict(raw)
    if "AutoConfig" in auto_map:
        raise _remote_code_error(model, f"config.json has auto_map.AutoConfig={auto_map['AutoConfig']!r}")
    if not model_type:
        logger.warning("%s has no model_type; parsing it as a generic PretrainedConfig.", path)
        return PretrainedConfig.from_dict(raw)
    raise ValueError(
        f"config.json of model {model!r} has model_type {model_type!r}, which transformers "
        f"{transformers.__version__} does not know. If the repository ships its own code pass "
        "trust_remote_code=True (CLI: --trust-remote-code); if it is a known model type under another name pass "
        'hf_overrides={"model_type": "llama"} (for example); otherwise upgrade transformers.'
    )


def _fill_architectures(config: Any) -> None:
    if getattr(config, "architectures", None):
        return
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    model_type = getattr(config, "model_type", None)
    arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(model_type) if model_type else None
    if arch is not None:
        config.architectures = [arch]
        logger.info("config has no `architectures`; using %s from model_type %r.", arch, model_type)
        return
    logger.warning(
        "config has no `architectures` and model_type %r maps to no known causal-LM class; pass "
        "hf_overrides={'architectures': ['<ArchitectureName>']} (CLI: --hf-overrides "
        '\'{"architectures": ["<ArchitectureName>"]}\') to the engine arguments.',
        model_type,
    )


def load_hf_config(
    model: str,
    *,
    hf_overrides: HfOverrides = None,
    trust_remote_code: bool = False,
    revision: str | None = None,
    config_format: str = "auto",
    cache_dir: str | None = None,
) -> tuple[Any, str, str]:
    """(PretrainedConfig after overrides, local folder, 'hf' | 'mistral')."""
    overrides_kw, overrides_fn = parse_hf_overrides(hf_overrides)
    model_path = resolve_model_path(model, revision, cache_dir)
    fmt = detect_config_format(model_path, config_format, model)
    if fmt == "mistral":
        config = mistral.params_to_hf_config(mistral.read_params(model_path))
        config.update(overrides_kw)
    else:
        config = _parse_hf_config(model, model_path, overrides_kw, overrides_fn, trust_remote_code)
    if overrides_fn is not None:
        config = overrides_fn(config)
        from transformers import PretrainedConfig

        if not isinstance(config, PretrainedConfig):
            raise ValueError(
                f"hf_overrides callable must return a PretrainedConfig, got {type(config).__name__}."
            )
    _fill_architectures(config)
    return config, model_path, fmt


def derive_max_model_len(hf_config: Any) -> int:
    """The longest context the config supports: the smallest length cap it declares, times rope scaling."""
    text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    values = [getattr(text_config, key, None) for key in _MAX_LEN_KEYS]
    caps = [int(v) for v in values if isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0]
    if not caps:
        logger.warning(
            "config declares no maximum length; assuming max_model_len=%d.", _DEFAULT_MAX_MODEL_LEN
        )
        return _DEFAULT_MAX_MODEL_LEN
    derived = min(caps)
    rope = getattr(text_config, "rope_parameters", None) or getattr(text_config, "rope_scaling", None)
    if isinstance(rope, dict):
        rope_type = rope.get("rope_type", rope.get("type"))
        factor = rope.get("factor")
        if rope_type in ("linear", "dynamic", "yarn") and isinstance(factor, (int, float)):
            if rope_type == "yarn" and rope.get("original_max_position_embeddings"):
                derived = int(rope["original_max_position_embeddings"])
            derived = int(derived * factor)
    return derived


def _config_dtype(hf_config: Any) -> Any:
    dtype = getattr(hf_config, "dtype", None)
    return dtype if isinstance(dtype, (str, torch.dtype)) else None


def create_model_config(
    model: str,
    *,
    tokenizer: str | None = None,
    served_model_name: str | None = None,
    dtype: str | torch.dtype = "auto",
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
    hf_overrides: HfOverrides = None,
    trust_remote_code: bool = False,
    model_impl: str = "auto",
    config_format: str = "auto",
    revision: str | None = None,
    seed: int = 0,
    hf_config_path: str | None = None,
    download_dir: str | None = None,
    load_format: str = "auto",
) -> ModelConfig:
    """Resolve everything about the model that does not need its weights; fail early and clearly.

    A GGUF file (or a folder holding one) is converted once into a cached HF folder in the serving
    dtype; `hf_config_path` then replaces the config its metadata gives.
    """
    from loraserve.models.registry import resolve_architecture

    torch_device = resolve_device(device) if isinstance(device, str) else device
    source = model
    gguf_file = find_gguf_file(model)
    if gguf_file is not None:
        source = gguf_folder(gguf_file, resolve_dtype(dtype, torch_device), hf_config_path)
    elif hf_config_path is not None:
        raise ValueError(
            "hf_config_path (--hf-config-path) applies to GGUF models, whose config comes from the file's "
            f"metadata; {model!r} is not a GGUF file. Edit its config.json or use hf_overrides instead."
        )
    hf_config, model_path, fmt = load_hf_config(
        source,
        hf_overrides=hf_overrides,
        trust_remote_code=trust_remote_code,
        revision=revision,
        config_format=config_format,
        cache_dir=download_dir,
    )
    architectures = tuple(getattr(hf_config, "architectures", None) or ())
    resolved = resolve_architecture(architectures, model_impl, hf_config=hf_config)
    logger.info(
        "model %s: architecture %s (%s)",
        model,
        resolved.arch_name,
        "native" if resolved.is_native else "transformers backend",
    )
    derived_len = derive_max_model_len(hf_config)
    if max_model_len is None:
        max_model_len = derived_len
    elif max_model_len <= 0:
        raise ValueError(f"max_model_len must be positive, got {max_model_len}.")
    elif max_model_len > derived_len:
        message = (  # vLLM's first sentence, which its users know
            f"User-specified max_model_len ({max_model_len}) is greater than the derived max_model_len "
            f"({derived_len}, from the model's config: max_position_embeddings or equivalent, with rope "
            "scaling)."
        )
        if not envs.allow_long_max_model_len():
            raise ValueError(
                f"{message} Lower max_model_len, or set VLLM_ALLOW_LONG_MAX_MODEL_LEN=1 to serve it anyway "
                "(positions beyond the model's training length give unreliable output)."
            )
        logger.warning("%s Serving it as VLLM_ALLOW_LONG_MAX_MODEL_LEN asks; make sure it is right.", message)
    download_weights(source, model_path, revision, fmt, load_format, download_dir)
    return ModelConfig(
        model=model,
        model_path=model_path,
        hf_config=hf_config,
        architectures=architectures,
        dtype=resolve_dtype(dtype, torch_device, _config_dtype(hf_config)),
        max_model_len=int(max_model_len),
        model_impl=model_impl,
        trust_remote_code=trust_remote_code,
        tokenizer=tokenizer or model_path,
        seed=seed,
        config_format=fmt,
        served_model_name=served_model_name or model,
        load_format=load_format,
    )
