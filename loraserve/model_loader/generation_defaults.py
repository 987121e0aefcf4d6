"""Default sampling parameters from a generation config, as vLLM's `--generation-config` gives them.

"auto" (vLLM's default) reads the model folder's generation_config.json, a folder reads that folder's,
"vllm" reads none. Only the sampling fields a model creator recommends are taken (temperature, top_p,
top_k, min_p, repetition_penalty; max_new_tokens becomes the offline API's default max_tokens), and
`override_generation_config` replaces any of them. They apply to a request only where it leaves the
field unset; an explicit value always wins.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Mapping
from typing import Any

logger = logging.getLogger(__name__)

GENERATION_CONFIG_FILE = "generation_config.json"
# generation_config.json key -> SamplingParams field
SAMPLING_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
    "max_new_tokens": "max_tokens",
}


def sampling_defaults(
    model_path: str, generation_config: str = "auto", overrides: Mapping[str, Any] | None = None
) -> dict[str, Any]:
    """SamplingParams field -> default value; ValueError for a missing folder, bad JSON or bad values."""
    raw = _read(model_path, generation_config)
    values = {SAMPLING_KEYS[key]: value for key, value in raw.items() if key in SAMPLING_KEYS and value is not None}
    for key, value in (overrides or {}).items():
        if key not in SAMPLING_KEYS:
            raise ValueError(
                f"override_generation_config key {key!r} is not a sampling default; use {sorted(SAMPLING_KEYS)}."
            )
        values[SAMPLING_KEYS[key]] = value
    from loraserve.sampling_params import SamplingParams

    SamplingParams(**values)  # the same checks as a request's own values, at startup
    if values:
        logger.info(
            "Default sampling parameters from the generation config: %s (requests that set a field keep their "
            "value; --generation-config vllm ignores the model's recommendations).",
            values,
        )
    return values


def _read(model_path: str, generation_config: str) -> dict[str, Any]:
    if generation_config == "vllm":
        return {}
    folder = model_path if generation_config == "auto" else os.path.expanduser(generation_config)
    path = os.path.join(folder, GENERATION_CONFIG_FILE)
    if not os.path.isfile(path):
        if generation_config == "auto":
            return {}
        raise ValueError(
            f"generation_config {generation_config!r}: no {GENERATION_CONFIG_FILE} in that folder; pass 'auto' "
            "(the model's), 'vllm' (none) or a folder that holds one."
        )
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"cannot read {path}: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path} must hold a JSON object.")
    return data
