r"""`PEFTHelper`: an adapter_config.json parsed and validated against what the server can serve.

Matching follows PEFT (read for facts): `target_modules` is a list of module-name suffixes or one
full-match regex; `rank_pattern` / `alpha_pattern` keys match a module when
`re.match(rf"(.*\.)?({key})$", module_name)` does, first key in file order wins (`patterns.py`
applies these rules); rsLoRA scales by alpha / sqrt(r) instead of alpha / r. `fan_in_fan_out` only says how the *base* Conv1D weight is
stored: PEFT keeps lora_A / lora_B in nn.Linear orientation either way, so it needs no handling here.
Every pattern from the config is compiled and matched by one `PatternMatcher` per adapter: the
`regex` engine under a time budget, each pattern's compiled size bounded before it is compiled, since
the patterns are client input. The file is bounded in bytes and in nesting depth before it is
decoded, and each field in size (`config_fields.py`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from loraserve.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from loraserve.json_limits import MAX_JSON_DEPTH, json_depth
from loraserve.lora.config_fields import CONFIG_NAME, ConfigFields, check_unsupported_features, shown
from loraserve.lora.patterns import PatternMatcher

# The vocab modules an adapter may carry LoRA, trainable tokens or a saved copy of (`lora/vocab_checks.py`).
VOCAB_LEAVES = frozenset({"embed_tokens", "lm_head"})

MAX_CONFIG_BYTES = 1 << 20  # real configs are a few KB


@dataclass(frozen=True)
class PEFTHelper:
    """The fields of a LoRA adapter_config.json that serving needs, validated."""

    adapter_name: str
    r: int
    lora_alpha: float
    target_modules: tuple[str, ...] | str | None
    exclude_modules: tuple[str, ...] | str | None
    layers_to_transform: tuple[int, ...] | None
    layers_pattern: tuple[str, ...] | None
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    use_rslora: bool
    fan_in_fan_out: bool
    bias: str
    lora_bias: bool
    use_dora: bool
    modules_to_save: tuple[str, ...]  # only vocab modules (VOCAB_LEAVES): the others are refused
    peft_type: str
    base_model_name_or_path: str | None
    bias_enabled: bool
    # PEFT's trainable_token_indices by vocab module leaf ("embed_tokens", "lm_head"); a list names the
    # embedding's (PEFT: and a tied head's).
    trainable_tokens: Mapping[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)
    config_json: str = ""  # canonical JSON of the file, part of the adapter's content digest
    patterns: PatternMatcher = dataclasses.field(
        default_factory=lambda: PatternMatcher(""), compare=False, repr=False
    )

    @classmethod
    def from_local_dir(
        cls, path: str | Path, lora_name: str, max_lora_rank: int, enable_lora_bias: bool = False
    ) -> PEFTHelper:
        """Read `path/adapter_config.json`; raise LoRAAdapterError naming the adapter and field."""
        folder = Path(path)
        try:
            is_dir = folder.is_dir()
        except OSError as e:  # a name too long, no permission: the client's path, not a server fault
            raise LoRAAdapterError(
                f"LoRA adapter '{lora_name}': its path is unusable ({e.strerror})"
            ) from None
        if not is_dir:  # the path is not echoed: it may be a server path (a resolver's folder)
            raise LoRAAdapterNotFoundError(
                f"No adapter found for LoRA adapter '{lora_name}': its path is not a directory"
            )
        config = read_adapter_config(folder, lora_name)
        return cls.from_dict(config, lora_name, max_lora_rank, enable_lora_bias)

    @classmethod
    def from_dict(
        cls, config: Any, lora_name: str, max_lora_rank: int, enable_lora_bias: bool = False
    ) -> PEFTHelper:
        if not isinstance(config, dict):
            raise LoRAAdapterError(
                f"LoRA adapter '{lora_name}': {CONFIG_NAME} must hold a JSON object, got {type(config).__name__}"
            )
        patterns = PatternMatcher(lora_name)  # one time budget for all of this adapter's patterns
        v = ConfigFields(lora_name, config, patterns)
        peft_type = v.get("peft_type", "LORA")
        if str(peft_type).upper() != "LORA":
            v.fail("peft_type", f"only LORA adapters are supported, got {shown(peft_type)}")
        r = v.positive_int("r", 8)
        rank_pattern = v.pattern_dict("rank_pattern", is_rank=True)
        for module, rank in [("", r), *rank_pattern.items()]:
            if rank > max_lora_rank:
                where = f" (rank_pattern {module!r})" if module else ""
                field = "rank_pattern" if module else "r"
                v.fail(field, f"LoRA rank {rank}{where} is greater than max_lora_rank {max_lora_rank}")
        use_dora = bool(v.get("use_dora", False))
        if use_dora and bool(v.get("lora_bias", False)):
            v.fail("use_dora", "DoRA with lora_bias is not supported")
        modules_to_save = v.name_list("modules_to_save")
        if any(m.rpartition(".")[2] not in VOCAB_LEAVES for m in modules_to_save):
            v.fail(
                "modules_to_save",
                "loraserve only supports modules_to_save being None or naming the vocab modules "
                f"{sorted(VOCAB_LEAVES)}, got {shown(list(modules_to_save))}",
            )
        check_unsupported_features(v, config)
        bias, lora_bias = v.get("bias", "none"), bool(v.get("lora_bias", False))
        if bias not in ("none", "all", "lora_only"):
            v.fail("bias", f"must be 'none', 'all' or 'lora_only', got {shown(bias)}")
        if (bias != "none" or lora_bias) and not enable_lora_bias:
            field = "bias" if bias != "none" else "lora_bias"
            v.fail(field, "Adapter bias cannot be used without bias_enabled (start with --enable-lora-bias)")
        return cls(
            adapter_name=lora_name,
            r=r,
            lora_alpha=v.number("lora_alpha", 8),
            target_modules=v.targets("target_modules"),
            exclude_modules=v.targets("exclude_modules"),
            layers_to_transform=v.int_list("layers_to_transform"),
            layers_pattern=v.layer_patterns("layers_pattern"),
            rank_pattern=rank_pattern,
            alpha_pattern=v.pattern_dict("alpha_pattern", is_rank=False),
            use_rslora=bool(v.get("use_rslora", False)),
            fan_in_fan_out=bool(v.get("fan_in_fan_out", False)),
            bias=bias,
            lora_bias=lora_bias,
            use_dora=use_dora,
            modules_to_save=modules_to_save,
            trainable_tokens=trainable_tokens(v),
            peft_type="LORA",
            base_model_name_or_path=v.get("base_model_name_or_path", None),
            bias_enabled=enable_lora_bias,
            config_json=json.dumps(config, sort_keys=True, default=str),
            patterns=patterns,
        )

    def rank_for(self, module_name: str) -> int:
        """Rank of `module_name` (full dotted name): rank_pattern first, else r."""
        key = self.patterns.first_key(self.rank_pattern, module_name, "rank_pattern")
        return self.rank_pattern[key] if key is not None else self.r

    def alpha_for(self, module_name: str) -> float:
        key = self.patterns.first_key(self.alpha_pattern, module_name, "alpha_pattern")
        return self.alpha_pattern[key] if key is not None else self.lora_alpha

    def scaling_for(self, module_name: str) -> float:
        """PEFT's scaling: alpha / r, or alpha / sqrt(r) with rsLoRA, per module."""
        rank, alpha = self.rank_for(module_name), self.alpha_for(module_name)
        return alpha / math.sqrt(rank) if self.use_rslora else alpha / rank

    def targets_module(self, module_name: str) -> bool:
        """Whether PEFT would have put a LoRA on `module_name` (full dotted name) under this config."""
        if self.exclude_modules is not None and self.patterns.matches_targets(
            self.exclude_modules, module_name, "exclude_modules"
        ):
            return False
        targets = self.target_modules
        if targets is None:
            return False
        if isinstance(targets, str):
            return self.patterns.matches_targets(targets, module_name, "target_modules")
        if module_name in targets:
            return True  # PEFT skips the layer filter for an exact name
        if not any(module_name.endswith(f".{t}") for t in targets):
            return False
        if not self.layers_to_transform:
            return True
        layer = self.patterns.layer_index(module_name, self.layers_pattern)
        return layer is not None and layer in self.layers_to_transform


def trainable_tokens(v: ConfigFields) -> dict[str, tuple[int, ...]]:
    """PEFT's trainable_token_indices: a list (the input embedding's) or {module: list}, modules
    being vocab modules only. Each module's ids are checked here (a list that is not empty, no
    negative or repeated id) and against the vocabulary when the weights are read (`vocab_checks`):
    every refusal names the adapter, the module and the id."""
    field = "trainable_token_indices"
    value = v.config.get(field)
    if value in (None, [], {}):
        return {}
    if isinstance(value, list):
        return {"embed_tokens": _token_ids(v, "embed_tokens", value)}
    if not isinstance(value, dict) or len(value) > 2:
        v.fail(field, f"must be a list of token ids or a dict of them by module, got {shown(value)}")
    out: dict[str, tuple[int, ...]] = {}
    for module, ids in value.items():
        leaf = str(module).rpartition(".")[2]
        if leaf not in VOCAB_LEAVES:
            v.fail(field, f"trainable tokens are served on {sorted(VOCAB_LEAVES)} only, got {shown(module)}")
        out[leaf] = _token_ids(v, str(module), ids)
    return out


def _token_ids(v: ConfigFields, module: str, ids: Any) -> tuple[int, ...]:
    """One module's trainable token ids: a non-empty list of distinct ids >= 0."""
    field = "trainable_token_indices"
    checked = ConfigFields(v.lora_name, {field: ids}, v.patterns).int_list(field) or ()
    if not checked:
        v.fail(field, f"the list of {module} is empty: name at least one token id, or leave the module out")
    seen: set[int] = set()
    for position, token_id in enumerate(checked):
        if token_id < 0:
            v.fail(field, f"{module} index {token_id} (at position {position}) is negative")
        if token_id in seen:
            v.fail(field, f"{module} index {token_id} (at position {position}) is repeated")
        seen.add(token_id)
    return checked


def read_adapter_config(folder: str | Path, lora_name: str) -> Any:
    """The parsed `folder/adapter_config.json`: a regular file of at most MAX_CONFIG_BYTES nesting at
    most MAX_JSON_DEPTH levels (counted before decoding), else a LoRAAdapterError. Opened non-blocking and checked on the open descriptor, so a FIFO, a device
    (`/dev/zero`) or a huge file swapped in can neither block the caller nor exhaust memory."""
    config_file = os.path.join(folder, CONFIG_NAME)
    try:
        fd = os.open(config_file, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise LoRAAdapterError(f"LoRA adapter '{lora_name}': {CONFIG_NAME} not found in its folder") from None
    except OSError as e:
        raise LoRAAdapterError(
            f"LoRA adapter '{lora_name}': cannot read {CONFIG_NAME} ({e.strerror})"
        ) from None
    with os.fdopen(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
            raise LoRAAdapterError(f"LoRA adapter '{lora_name}': {CONFIG_NAME} is not a regular file")
        try:
            data = f.read(MAX_CONFIG_BYTES + 1)
        except OSError as e:
            raise LoRAAdapterError(
                f"LoRA adapter '{lora_name}': cannot read {CONFIG_NAME} ({e.strerror})"
            ) from None
    if len(data) > MAX_CONFIG_BYTES:
        raise LoRAAdapterError(
            f"LoRA adapter '{lora_name}': {CONFIG_NAME} is larger than {MAX_CONFIG_BYTES} bytes"
        )
    depth = json_depth(data)
    if depth > MAX_JSON_DEPTH:
        raise LoRAAdapterError(
            f"LoRA adapter '{lora_name}': {CONFIG_NAME} nests {depth} levels deep, more than the "
            f"{MAX_JSON_DEPTH} allowed"
        )
    try:
        return json.loads(data.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LoRAAdapterError(f"LoRA adapter '{lora_name}': {CONFIG_NAME} is not valid JSON ({e})") from None
