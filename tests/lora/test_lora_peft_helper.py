"""adapter_config.json parsing: each bad adapter gets its own error; PEFT's matching rules as oracle."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
import torch
from support.adapter_files import unsafe_configs

from loraserve.errors import LoRAAdapterError, LoRAAdapterNotFoundError
from loraserve.json_limits import MAX_JSON_DEPTH as MAX_CONFIG_DEPTH
from loraserve.lora.peft_helper import PEFTHelper


def _write(folder: Path, config: Any) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    text = config if isinstance(config, str) else json.dumps(config)
    (folder / "adapter_config.json").write_text(text)
    return folder


def _base(**overrides: Any) -> dict[str, Any]:
    config: dict[str, Any] = {
        "peft_type": "LORA",
        "r": 8,
        "lora_alpha": 16,
        "target_modules": ["q_proj", "v_proj"],
        "bias": "none",
        "use_dora": False,
        "modules_to_save": None,
    }
    config.update(overrides)
    return config


def test_parses_fields(tmp_path: Path) -> None:
    folder = _write(
        tmp_path / "a", _base(layers_to_transform=[1], layers_pattern="layers", fan_in_fan_out=True)
    )
    helper = PEFTHelper.from_local_dir(folder, "a", max_lora_rank=16)
    assert helper.r == 8 and helper.lora_alpha == 16.0 and helper.target_modules == ("q_proj", "v_proj")
    assert helper.layers_to_transform == (1,) and helper.layers_pattern == ("layers",)
    assert helper.fan_in_fan_out and helper.peft_type == "LORA" and helper.bias == "none"
    assert helper.scaling_for("model.layers.0.self_attn.q_proj") == 2.0


@pytest.mark.parametrize(
    ("overrides", "field", "message"),
    [
        ({"peft_type": "IA3"}, "peft_type", "only LORA"),
        ({"r": 0}, "r", "positive integer"),
        ({"r": -4}, "r", "positive integer"),
        ({"r": "8"}, "r", "positive integer"),
        ({"r": 32}, "r", "LoRA rank 32 is greater than max_lora_rank 16"),
        (
            {"rank_pattern": {"q_proj": 64}},
            "rank_pattern",
            "LoRA rank 64 .* is greater than max_lora_rank 16",
        ),
        ({"use_dora": True, "lora_bias": True}, "use_dora", "DoRA with lora_bias is not supported"),
        ({"modules_to_save": ["score"]}, "modules_to_save", "only supports modules_to_save being None"),
        ({"bias": "all"}, "bias", "Adapter bias cannot be used without bias_enabled"),
        ({"bias": "lora_only"}, "bias", "Adapter bias cannot be used without bias_enabled"),
        ({"lora_bias": True}, "lora_bias", "Adapter bias cannot be used without bias_enabled"),
        ({"bias": "sometimes"}, "bias", "must be 'none'"),
        ({"lora_alpha": "x"}, "lora_alpha", "finite number"),
        ({"target_modules": "q_proj(("}, "target_modules", "invalid regular expression"),
        ({"target_modules": "q" * 5000}, "target_modules", "longer than 4096 characters"),
        ({"layers_pattern": "layers(("}, "layers_pattern", "invalid regular expression"),
        ({"rank_pattern": {"q_proj((": 4}}, "rank_pattern", "invalid regular expression"),
        ({"alpha_pattern": {"q_proj": "big"}}, "alpha_pattern", "finite number"),
        ({"use_qalora": True}, "use_qalora", "QA-LoRA is not supported"),
        ({"alora_invocation_tokens": [1, 2]}, "alora_invocation_tokens", "is not supported"),
        ({"init_lora_weights": "pissa"}, "init_lora_weights", "modify the base weights"),
        ({"target_parameters": ["experts.w1"]}, "target_parameters", "is not supported"),
        # Trainable tokens (vLLM refuses these at load): the module and the index are named.
        (
            {"trainable_token_indices": [3, -2]},
            "trainable_token_indices",
            r"embed_tokens index -2 \(at position 1\) is negative",
        ),
        (
            {"trainable_token_indices": [7, 4, 7]},
            "trainable_token_indices",
            r"embed_tokens index 7 \(at position 2\) is repeated",
        ),
        (
            {"trainable_token_indices": {"lm_head": [1, 1]}},
            "trainable_token_indices",
            "lm_head index 1 .* is repeated",
        ),
        (
            {"trainable_token_indices": {"model.embed_tokens": [5], "lm_head": []}},
            "trainable_token_indices",
            "the list of lm_head is empty",
        ),
        (
            {"trainable_token_indices": {"embed_tokens": [0, -1]}},
            "trainable_token_indices",
            "embed_tokens index -1 .* is negative",
        ),
        # Sizes: each entry is matched against every module of the model.
        ({"target_modules": ["q_proj"] * 1025}, "target_modules", "1025 entries, more than the 1024 allowed"),
        ({"exclude_modules": ["o_proj"] * 2000}, "exclude_modules", "2000 entries"),
        ({"layers_to_transform": list(range(1025))}, "layers_to_transform", "1025 entries"),
        ({"rank_pattern": {f"k{i}": 4 for i in range(1025)}}, "rank_pattern", "1025 entries"),
        ({"alpha_pattern": {f"k{i}": 4 for i in range(1025)}}, "alpha_pattern", "1025 entries"),
        (
            {"target_modules": "(?:(?:(?:a{1000}){1000}){1000})"},
            "target_modules",
            "more than 10000 regex nodes",
        ),
    ],
)
def test_each_bad_config_has_its_error(
    tmp_path: Path, overrides: dict[str, Any], field: str, message: str
) -> None:
    folder = _write(tmp_path / "bad", _base(**overrides))
    with pytest.raises(LoRAAdapterError, match=message) as info:
        PEFTHelper.from_local_dir(folder, "bad-adapter", max_lora_rank=16)
    assert "'bad-adapter'" in str(info.value) and f"field '{field}'" in str(info.value)
    assert type(info.value) is LoRAAdapterError


def test_a_refused_value_is_shown_short(tmp_path: Path) -> None:
    """The message goes back to the client: a megabyte-sized value is not echoed whole."""
    for field, value in (("peft_type", "x" * 500_000), ("bias", ["b"] * 100_000), ("r", "9" * 100_000)):
        folder = _write(tmp_path / field, _base(**{field: value}))
        with pytest.raises(LoRAAdapterError, match=f"field '{field}'") as info:
            PEFTHelper.from_local_dir(folder, "big", max_lora_rank=16)
        assert len(str(info.value)) < 300, field


def _nested(levels: int) -> Any:
    value: Any = 0
    for _ in range(levels):
        value = [value]
    return value


def test_config_nesting_is_bounded_before_decoding(tmp_path: Path) -> None:
    """100k levels (a 500 from RecursionError before) is a 400 naming the adapter and the problem;
    the bound is exact, and brackets inside strings do not nest."""
    deep = '{"r": 8, "x": ' + "[" * 100_000 + "]" * 100_000 + "}"
    with pytest.raises(
        LoRAAdapterError,
        match="'deep': adapter_config.json nests 100001 levels deep, more than the 64 allowed",
    ) as info:
        PEFTHelper.from_local_dir(_write(tmp_path / "deep", deep), "deep", max_lora_rank=16)
    assert type(info.value) is LoRAAdapterError
    at_bound = _write(tmp_path / "at", _base(extra=_nested(MAX_CONFIG_DEPTH - 1)))  # the object is a level
    assert PEFTHelper.from_local_dir(at_bound, "at", max_lora_rank=16).r == 8
    with pytest.raises(LoRAAdapterError, match=f"nests {MAX_CONFIG_DEPTH + 1} levels deep"):
        PEFTHelper.from_local_dir(
            _write(tmp_path / "over", _base(extra=_nested(MAX_CONFIG_DEPTH))), "over", 16
        )
    in_strings = _write(tmp_path / "s", _base(note="[{" * 100_000 + '\\"[', other='"]]]'))
    assert PEFTHelper.from_local_dir(in_strings, "s", max_lora_rank=16).r == 8


def test_pattern_matching_is_time_bounded_per_adapter() -> None:
    # Catastrophic by orders of magnitude (years of backtracking) against a 1 s budget per adapter.
    helper = PEFTHelper.from_dict(_base(target_modules="(?:.|.)*(?:.|.)*[0-9]{5}"), "slow", max_lora_rank=16)
    with pytest.raises(
        LoRAAdapterError, match="'slow': the pattern in field 'target_modules' .*took too long"
    ):
        helper.targets_module("model.layers.0.self_attn.q_proj")
    with pytest.raises(LoRAAdapterError, match="took too long"):  # the budget is spent: refused at once
        helper.targets_module("model.layers.1.self_attn.q_proj")
    fine = PEFTHelper.from_dict(_base(target_modules=r".*\.(q|v)_proj"), "fine", max_lora_rank=16)
    assert fine.targets_module("model.layers.0.self_attn.q_proj") and not fine.targets_module(
        "model.layers.0.mlp.up_proj"
    )


def test_bias_allowed_with_flag(tmp_path: Path) -> None:
    folder = _write(tmp_path / "b", _base(bias="lora_only", lora_bias=True))
    helper = PEFTHelper.from_local_dir(folder, "b", max_lora_rank=16, enable_lora_bias=True)
    assert helper.bias == "lora_only" and helper.lora_bias and helper.bias_enabled


def test_missing_or_broken_files(tmp_path: Path) -> None:
    with pytest.raises(LoRAAdapterNotFoundError, match="No adapter found for LoRA adapter 'gone'"):
        PEFTHelper.from_local_dir(tmp_path / "nope", "gone", max_lora_rank=16)
    (tmp_path / "empty").mkdir()
    with pytest.raises(LoRAAdapterError, match="adapter_config.json not found") as info:
        PEFTHelper.from_local_dir(tmp_path / "empty", "empty", max_lora_rank=16)
    assert type(info.value) is LoRAAdapterError
    with pytest.raises(LoRAAdapterError, match="not valid JSON"):
        PEFTHelper.from_local_dir(_write(tmp_path / "j", "{r: 8,"), "j", max_lora_rank=16)
    with pytest.raises(LoRAAdapterError, match="JSON object"):
        PEFTHelper.from_local_dir(_write(tmp_path / "l", "[1, 2]"), "l", max_lora_rank=16)


def test_config_files_that_are_not_small_regular_files_are_refused(tmp_path: Path) -> None:
    for name, (folder, why) in unsafe_configs(tmp_path).items():
        with pytest.raises(LoRAAdapterError, match=why):
            PEFTHelper.from_local_dir(folder, name, max_lora_rank=16)


def test_rslora_scaling(tmp_path: Path) -> None:
    helper = PEFTHelper.from_local_dir(_write(tmp_path / "rs", _base(r=4, use_rslora=True)), "rs", 16)
    assert math.isclose(helper.scaling_for("model.layers.0.self_attn.q_proj"), 16 / math.sqrt(4))


def _tiny_llama() -> Any:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2,
    )  # fmt: skip
    return LlamaForCausalLM(cfg)


@pytest.mark.parametrize(
    "config_kwargs",
    [
        {
            "target_modules": ["q_proj", "v_proj", "down_proj"],
            "rank_pattern": {"layers.1.self_attn.q_proj": 2, r"layers\.2\..*proj": 6},
            "alpha_pattern": {"v_proj": 3.0, "down_proj": 5},
        },
        {"target_modules": r".*\.(k_proj|up_proj)", "use_rslora": True, "lora_alpha": 7},
        {
            "target_modules": ["o_proj", "gate_proj"],
            "layers_to_transform": [0, 2],
            "layers_pattern": "layers",
        },
        {"target_modules": ["q_proj", "up_proj"], "layers_to_transform": [1], "exclude_modules": ["up_proj"]},
        {  # small counted repeats stay accepted, and match as PEFT's re does
            "target_modules": r"model\.layers\.\d{1}\.(self_attn\.(q|v)|mlp\.up)_proj",
            "rank_pattern": {r"layers\.[0-1]{1,2}\.self_attn\.q_proj": 2},
        },
    ],
)
def test_matching_agrees_with_peft(tmp_path: Path, config_kwargs: dict[str, Any]) -> None:
    """targets_module / rank_for / scaling_for against the LoRA layers PEFT actually built."""
    from peft import LoraConfig, get_peft_model
    from peft.tuners.lora import LoraLayer

    peft_model = get_peft_model(_tiny_llama(), LoraConfig(**{"r": 4, "lora_alpha": 8, **config_kwargs}))
    peft_model.save_pretrained(tmp_path / "ad")
    helper = PEFTHelper.from_local_dir(tmp_path / "ad", "ad", max_lora_rank=16)
    base = peft_model.base_model.model
    peft_layers = {n: m for n, m in base.named_modules() if isinstance(m, LoraLayer)}
    assert peft_layers
    for name, module in base.named_modules():
        if isinstance(module, torch.nn.Linear) and not name.endswith(("lora_A.default", "lora_B.default")):
            assert helper.targets_module(name) == (name in peft_layers), name
    for name, layer in peft_layers.items():
        assert helper.rank_for(name) == layer.r["default"], name
        assert math.isclose(helper.scaling_for(name), layer.scaling["default"]), name
