"""`ConfigFields`: typed, bounded access to the fields of one adapter_config.json.

The config is client input (a load request's folder, a resolver's store). Besides its type, every
field is bounded in size: lists and pattern tables hold at most `MAX_FIELD_ITEMS` entries (each is
matched against every module of the model), and a refused value is shown cut to `MAX_SHOWN_CHARS`
(the message goes back to the client, the config may be a megabyte). Every refusal is a
LoRAAdapterError naming the adapter and the field.
"""

from __future__ import annotations

import math
from typing import Any, NoReturn

from loraserve.errors import LoRAAdapterError
from loraserve.lora.patterns import PatternMatcher, key_regex, layers_regex

CONFIG_NAME = "adapter_config.json"
MAX_FIELD_ITEMS = 1024  # a rank_pattern per layer and module of a 100-layer model is ~700 keys
MAX_SHOWN_CHARS = 80

# LoraConfig fields that change what the adapter computes; any non-default value is refused.
_UNSUPPORTED_FIELDS: dict[str, str] = {
    "use_qalora": "QA-LoRA",
    "alora_invocation_tokens": "activated LoRA (aLoRA)",
    "layer_replication": "layer replication",
    "target_parameters": "LoRA on parameters (target_parameters) other than MoE experts' gate_up_proj and down_proj",
    "arrow_config": "Arrow routing",
    "use_bdlora": "block-diagonal LoRA",
    "kasa_config": "KaSA",
    "velora_config": "VeLoRA",
    "monteclora_config": "MonteCLoRA",
}
# Initialisations that also rewrite the base weights: such an adapter is wrong on the original base
# unless it was converted (PEFT's path_initial_model_for_weight_conversion saves init_lora_weights=True).
_BASE_MODIFYING_INITS = ("pissa", "olora", "corda", "lora_ga")


def shown(value: Any) -> str:
    """`repr(value)`, cut to MAX_SHOWN_CHARS."""
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else text[: MAX_SHOWN_CHARS - 3] + "..."


# target_parameters served: the stacked expert tensors of the native MoE models (lora/expert_checks.py),
# by name or dotted suffix ("experts.down_proj"; PEFT writes bare "gate_up_proj" / "down_proj" when it
# moved target_modules gate_proj/up_proj/down_proj onto transformers' fused experts).
_EXPERT_PARAMETERS = ("gate_up_proj", "down_proj")


def _expert_parameters_only(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(p, str)
        and (p in _EXPERT_PARAMETERS or p.endswith(tuple("." + e for e in _EXPERT_PARAMETERS)))
        for p in value
    )


def check_unsupported_features(v: ConfigFields, config: dict[str, Any]) -> None:
    for field, feature in _UNSUPPORTED_FIELDS.items():
        value = config.get(field)
        if field == "target_parameters" and _expert_parameters_only(value):
            continue
        if value not in (None, False, [], {}, ""):
            v.fail(field, f"{feature} is not supported")
    init = config.get("init_lora_weights", True)
    if isinstance(init, str) and init.lower().startswith(_BASE_MODIFYING_INITS):
        v.fail(
            "init_lora_weights",
            f"{shown(init)} adapters also modify the base weights; convert the adapter with PEFT's "
            "path_initial_model_for_weight_conversion first",
        )


class ConfigFields:
    """Typed field access that raises LoRAAdapterError naming the adapter and the field."""

    def __init__(self, lora_name: str, config: dict[str, Any], patterns: PatternMatcher) -> None:
        self.lora_name = lora_name
        self.config = config
        self.patterns = patterns

    def fail(self, field: str, message: str) -> NoReturn:
        raise LoRAAdapterError(
            f"LoRA adapter '{self.lora_name}': {message} (field '{field}' in {CONFIG_NAME})"
        )

    def get(self, field: str, default: Any) -> Any:
        value = self.config.get(field)
        return default if value is None else value

    def positive_int(self, field: str, default: int) -> int:
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            self.fail(field, f"LoRA rank must be a positive integer, got {shown(value)}")
        return int(value)

    def number(self, field: str, default: float) -> float:
        value = self.get(field, default)
        if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
            self.fail(field, f"must be a finite number, got {shown(value)}")
        return float(value)

    def name_list(self, field: str) -> tuple[str, ...]:
        value = self.get(field, [])
        if isinstance(value, str):
            value = [value]
        if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
            self.fail(field, f"must be a string or a list of strings, got {shown(value)}")
        self._check_items(field, value)
        return tuple(value)

    def targets(self, field: str) -> tuple[str, ...] | str | None:
        value = self.config.get(field)
        if value is None or isinstance(value, list | tuple):
            return None if value is None else self.name_list(field)
        if not isinstance(value, str):
            self.fail(field, f"must be a regex string or a list of module names, got {shown(value)}")
        self.patterns.compile(value, field)
        return str(value)

    def layer_patterns(self, field: str) -> tuple[str, ...] | None:
        names = self.name_list(field)
        for name in names:
            self.patterns.compile(layers_regex(name), field)
        return names or None

    def int_list(self, field: str) -> tuple[int, ...] | None:
        value = self.config.get(field)
        if value is None:
            return None
        values = [value] if isinstance(value, int) else value
        if not isinstance(values, list) or not all(
            isinstance(v, int) and not isinstance(v, bool) for v in values
        ):
            self.fail(field, f"must be an integer or a list of integers, got {shown(value)}")
        self._check_items(field, values)
        return tuple(values)

    def pattern_dict(self, field: str, is_rank: bool) -> dict[str, Any]:
        value = self.get(field, {})
        if not isinstance(value, dict):
            self.fail(field, f"must be an object mapping module patterns to values, got {shown(value)}")
        self._check_items(field, value)
        parsed: dict[str, Any] = {}
        for key, item in value.items():
            self.patterns.compile(key_regex(key), field)
            bad_rank = isinstance(item, bool) or not isinstance(item, int) or item <= 0
            bad_alpha = isinstance(item, bool) or not isinstance(item, int | float) or not math.isfinite(item)
            if bad_rank if is_rank else bad_alpha:
                kind = "a positive integer rank" if is_rank else "a finite number"
                self.fail(field, f"value for {shown(key)} must be {kind}, got {shown(item)}")
            parsed[key] = int(item) if is_rank else float(item)
        return parsed

    def _check_items(self, field: str, items: list[Any] | dict[str, Any]) -> None:
        if len(items) > MAX_FIELD_ITEMS:
            self.fail(field, f"has {len(items)} entries, more than the {MAX_FIELD_ITEMS} allowed")
