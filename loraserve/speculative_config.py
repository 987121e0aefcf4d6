"""`SpeculativeConfig`: vLLM's `--speculative-config` JSON, checked once and frozen.

Two methods are served: "ngram" (proposals looked up in the request's own prompt and output) and a
draft model ("draft_model", implied by a `model`: a smaller model with the target's tokenizer, a GGUF
file or a Hugging Face folder, loaded like the target). vLLM's other methods (EAGLE, Medusa, MTP) need
trained heads this server does not load, so they are refused by name. Fields of vLLM's that change
nothing here (`disable_padded_drafter_batch`, `draft_tensor_parallel_size` 1) are accepted; unknown
fields are refused, so a misspelt one never silently does nothing.

loraserve's own fields: `draft_lora_modules` ({target adapter name: draft adapter path}: the draft
adapter that proposes for a request of that adapter; others propose with the base draft) and
`draft_policy` ("adaptive": each step drafts what its measured cost and each request's acceptance
say pays, vLLM's `disable_by_batch_size` on top; "always": every proposal up to
`num_speculative_tokens`, as vLLM drafts). Torch-free, like all option parsing.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SERVED_METHODS = ("ngram", "draft_model")
_REFUSED_METHODS = ("eagle", "eagle3", "medusa", "mlp_speculator", "deepseek_mtp", "mtp", "ernie_mtp",
                    "qwen3_next_mtp", "mimo_mtp", "longcat_flash_mtp", "suffix")  # fmt: skip
POLICIES = ("adaptive", "always")
_NO_EFFECT = ("disable_padded_drafter_batch", "draft_tensor_parallel_size", "revision", "code_revision")
MAX_SPECULATIVE_TOKENS = 32  # a step's rows per sequence stay bounded whatever the config says


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 0  # ngram only
    prompt_lookup_max: int = 0
    model: str | None = None  # the draft model (draft_model only)
    quantization: str | None = None  # the draft's --quantization
    max_model_len: int | None = None  # the draft's context limit (no proposals past it)
    draft_lora_modules: Mapping[str, str] = field(default_factory=dict)
    disable_by_batch_size: int | None = None
    draft_policy: str = "adaptive"

    @classmethod
    def from_options(cls, values: Mapping[str, Any]) -> SpeculativeConfig:
        """From the JSON object; ValueError (naming the field) for what cannot be served."""
        values = dict(values)
        known = {f for f in cls.__dataclass_fields__} | set(_NO_EFFECT)
        unknown = sorted(set(values) - known)
        if unknown:
            raise ValueError(f"speculative_config has unknown field(s): {', '.join(unknown)}.")
        tp = values.pop("draft_tensor_parallel_size", None)
        if tp not in (None, 1):
            raise ValueError(
                f"draft_tensor_parallel_size {tp} is not served: the draft runs in this process (1)."
            )
        for name in _NO_EFFECT:
            values.pop(name, None)
        method = values.get("method") or ("draft_model" if values.get("model") else None)
        if method == "[ngram]":  # vLLM's older spelling
            method = "ngram"
        if method is None:
            raise ValueError("speculative_config needs a 'method' ('ngram') or a draft 'model'.")
        if method not in SERVED_METHODS:
            what = (
                "needs trained heads this server does not load"
                if method in _REFUSED_METHODS
                else "is unknown"
            )
            raise ValueError(
                f"speculative method {method!r} {what}; served: 'ngram' and a draft 'model' ('draft_model')."
            )
        values["method"] = method
        policy = values.get("draft_policy", "adaptive")
        if policy not in POLICIES:
            raise ValueError(f"draft_policy must be one of {', '.join(POLICIES)}, got {policy!r}.")
        _positive(values, "disable_by_batch_size")
        k = values.get("num_speculative_tokens")
        if isinstance(k, bool) or not isinstance(k, int) or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be an integer in 1..{MAX_SPECULATIVE_TOKENS}, got {k!r}."
            )
        if method == "ngram":
            _ngram_window(values)
            for name in ("model", "quantization", "max_model_len"):
                if values.get(name) is not None:
                    raise ValueError(
                        f"'{name}' is a draft model's field; the ngram method has no draft model."
                    )
            if values.get("draft_lora_modules"):
                raise ValueError("draft_lora_modules needs a draft 'model'; the ngram method has none.")
        else:
            _draft_model_fields(values)
        return cls(**values)


def _positive(values: dict[str, Any], name: str) -> int | None:
    value = values.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name}={value!r} must be an integer > 0.")
    return value


def _ngram_window(values: dict[str, Any]) -> None:
    """vLLM's defaults: both unset 5 and 5, one unset the other's value; min <= max."""
    low, high = _positive(values, "prompt_lookup_min"), _positive(values, "prompt_lookup_max")
    if low is None and high is None:
        low = high = 5
    low = high if low is None else low
    high = low if high is None else high
    assert low is not None and high is not None
    if low > high:
        raise ValueError(f"prompt_lookup_min={low} must be <= prompt_lookup_max={high}.")
    if high > 64:
        raise ValueError(f"prompt_lookup_max={high} must be <= 64.")
    values["prompt_lookup_min"], values["prompt_lookup_max"] = low, high


def _draft_model_fields(values: dict[str, Any]) -> None:
    model = values.get("model")
    if not isinstance(model, str) or not model:
        raise ValueError("the draft_model method needs the draft's 'model' (a GGUF file or a model folder).")
    for name in ("prompt_lookup_min", "prompt_lookup_max"):
        if values.get(name) is not None:
            raise ValueError(f"'{name}' is the ngram method's field; a draft model proposes by itself.")
        values.pop(name, None)
    _positive(values, "max_model_len")
    modules = values.get("draft_lora_modules") or {}
    if not isinstance(modules, Mapping) or not all(
        isinstance(name, str) and name and isinstance(path, str) and path for name, path in modules.items()
    ):
        raise ValueError(
            "draft_lora_modules must be a JSON object {target adapter name: draft adapter path}, non-empty strings."
        )
    values["draft_lora_modules"] = dict(modules)


def check_speculative_options(values: Mapping[str, Any]) -> str | None:
    """The option field's check: what is wrong with the JSON object (after the field's name), or None."""
    try:
        SpeculativeConfig.from_options(values)
    except (TypeError, ValueError) as exc:
        return f"is not valid: {exc}"
    return None
