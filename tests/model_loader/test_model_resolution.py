"""Model resolution: format detection, hf_overrides, architecture fill and choice, max_model_len, errors.

Reproduces the three resolution failures of vLLM's model-resolution guide (missing `architectures`,
an unofficial architecture name, several candidate architectures) and their `hf_overrides` repairs.
Only config files are written: resolution must never need weights.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
import torch
import transformers
from support.mini_llama import MINI_LLAMA

from loraserve.model_loader.config import create_model_config, derive_max_model_len, load_hf_config
from loraserve.models.registry import get_supported_archs, resolve_architecture

NATIVE = [
    "GPT2LMHeadModel",
    "Gemma2ForCausalLM",
    "Gemma3ForCausalLM",
    "Gemma3ForConditionalGeneration",
    "GemmaForCausalLM",
    "Idefics3ForConditionalGeneration",
    "LlamaForCausalLM",
    "LlavaForConditionalGeneration",
    "LlavaNextForConditionalGeneration",
    "MistralForCausalLM",
    "MixtralForCausalLM",
    "OlmoeForCausalLM",
    "Phi3ForCausalLM",
    "Qwen2ForCausalLM",
    "Qwen2MoeForCausalLM",
    "Qwen2VLForConditionalGeneration",
    "Qwen2_5_VLForConditionalGeneration",
    "Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM",
    "SmolVLMForConditionalGeneration",
]


def _llama_dict(**changes: Any) -> dict[str, Any]:
    config = transformers.LlamaConfig(**MINI_LLAMA).to_dict()
    config["architectures"] = ["LlamaForCausalLM"]
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    return config


def _write_config(folder: Path, config: dict[str, Any]) -> str:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return str(folder)


def _model_config(path: str, **kwargs: Any) -> Any:
    kwargs.setdefault("dtype", "float32")
    return create_model_config(path, device="cpu", **kwargs)


def test_supported_archs_lists_the_native_table() -> None:
    assert get_supported_archs() == NATIVE


# Failure 1: config.json without `architectures`.
def test_missing_architectures_filled_from_known_model_type(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write_config(tmp_path, _llama_dict(architectures=None))
    with caplog.at_level(logging.INFO, logger="loraserve.model_loader.config"):
        config = _model_config(path)
    assert config.architectures == ("LlamaForCausalLM",)
    assert "using LlamaForCausalLM from model_type 'llama'" in caplog.text


def test_missing_architectures_unknown_model_type_warns_then_override_fixes(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = _write_config(tmp_path, _llama_dict(architectures=None, model_type=None))
    with caplog.at_level(logging.WARNING), pytest.raises(ValueError) as err:
        _model_config(path)
    assert "hf_overrides={'architectures'" in caplog.text
    assert "lists no `architectures`" in str(err.value)
    assert all(arch in str(err.value) for arch in NATIVE)

    config = _model_config(path, hf_overrides={"architectures": ["LlamaForCausalLM"]})
    assert config.architectures == ("LlamaForCausalLM",)
    assert config.hf_config.hidden_size == 32


# Failure 2: an unofficial architecture name.
def test_unofficial_architecture_name_errors_with_supported_list(tmp_path: Path) -> None:
    path = _write_config(tmp_path, _llama_dict(architectures=["MyLlamaForCausalLM"]))
    with pytest.raises(ValueError) as err:
        _model_config(path)
    message = str(err.value)
    assert "['MyLlamaForCausalLM']" in message
    assert all(arch in message for arch in NATIVE)
    assert 'hf_overrides={"architectures": ["LlamaForCausalLM"]}' in message
    assert "--hf-overrides" in message


def _set_llama_arch(config: Any) -> Any:
    config.architectures = ["LlamaForCausalLM"]
    return config


@pytest.mark.parametrize(
    "overrides",
    [
        {"architectures": ["LlamaForCausalLM"]},
        _set_llama_arch,
        '{"architectures": ["LlamaForCausalLM"]}',
    ],
    ids=["dict", "callable", "json"],
)
def test_unofficial_architecture_name_repaired_by_overrides(tmp_path: Path, overrides: Any) -> None:
    path = _write_config(tmp_path, _llama_dict(architectures=["MyLlamaForCausalLM"]))
    config = _model_config(path, hf_overrides=overrides)
    assert config.architectures == ("LlamaForCausalLM",)
    assert resolve_architecture(config.architectures).arch_name == "LlamaForCausalLM"


# Failure 3: several candidate architectures; order decides and the override picks.
def test_first_resolvable_architecture_in_order_wins(tmp_path: Path) -> None:
    path = _write_config(tmp_path, _llama_dict(architectures=["MyCustomForCausalLM", "LlamaForCausalLM"]))
    config = _model_config(path)
    assert resolve_architecture(config.architectures).arch_name == "LlamaForCausalLM"
    assert resolve_architecture(["Qwen2ForCausalLM", "LlamaForCausalLM"]).arch_name == "Qwen2ForCausalLM"
    assert resolve_architecture(["LlamaForCausalLM", "Qwen2ForCausalLM"]).arch_name == "LlamaForCausalLM"
    picked = _model_config(path, hf_overrides={"architectures": ["MistralForCausalLM", "LlamaForCausalLM"]})
    assert resolve_architecture(picked.architectures).arch_name == "MistralForCausalLM"


def test_model_impl_modes_and_name_normalization() -> None:
    listed = ["GPTNeoXForCausalLM", "LlamaForCausalLM"]
    assert resolve_architecture(listed, "auto") == resolve_architecture(["LlamaForCausalLM"], "native")
    fallback = resolve_architecture(listed, "transformers")
    assert (fallback.arch_name, fallback.is_native) == ("GPTNeoXForCausalLM", False)
    only_neox = resolve_architecture(["GPTNeoXForCausalLM"], "auto")
    assert (only_neox.arch_name, only_neox.is_native) == ("GPTNeoXForCausalLM", False)
    with pytest.raises(ValueError, match="model_impl='transformers'"):
        resolve_architecture(["GPTNeoXForCausalLM"], "native")
    with pytest.raises(ValueError, match="MyLlamaForCausalLM"):
        resolve_architecture(["MyLlamaForCausalLM"], "transformers")
    with pytest.raises(ValueError, match="model_impl must be one of"):
        resolve_architecture(["LlamaForCausalLM"], "fast")
    assert resolve_architecture([" llamaforcausallm "]).arch_name == "LlamaForCausalLM"
    assert resolve_architecture([" llamaforcausallm "]).is_native


def test_model_type_override_applies_before_config_class_is_chosen(tmp_path: Path) -> None:
    path = _write_config(tmp_path, _llama_dict(model_type="my_llama"))
    with pytest.raises(ValueError) as err:
        load_hf_config(path)
    assert "'my_llama'" in str(err.value) and "trust_remote_code=True" in str(err.value)

    config, _, fmt = load_hf_config(path, hf_overrides={"model_type": "llama"})
    assert type(config) is transformers.LlamaConfig and fmt == "hf"

    def to_mistral(config: Any) -> Any:
        config.model_type = "mistral"
        return config

    config, _, _ = load_hf_config(path, hf_overrides=to_mistral)
    assert type(config) is transformers.MistralConfig
    assert config.num_key_value_heads == 2


def test_dict_override_replaces_top_level_values(tmp_path: Path) -> None:
    path = _write_config(tmp_path, _llama_dict())
    config = _model_config(path, hf_overrides={"max_position_embeddings": 64, "rms_norm_eps": 0.5})
    assert config.max_model_len == 64
    assert config.hf_config.rms_norm_eps == 0.5


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ("{not json", "not valid JSON"),
        ('["LlamaForCausalLM"]', "must be a JSON object"),
        (42, "must be a dict"),
    ],
)
def test_bad_hf_overrides_are_clear_errors(tmp_path: Path, overrides: Any, match: str) -> None:
    path = _write_config(tmp_path, _llama_dict())
    with pytest.raises(ValueError, match=match):
        load_hf_config(path, hf_overrides=overrides)


def test_callable_override_must_return_a_config(tmp_path: Path) -> None:
    path = _write_config(tmp_path, _llama_dict())
    with pytest.raises(ValueError, match="must return a PretrainedConfig"):
        load_hf_config(path, hf_overrides=lambda config: None)


def test_custom_code_requires_trust_remote_code(tmp_path: Path) -> None:
    config = _llama_dict(model_type="my_custom_lm", architectures=["MyCustomForCausalLM"])
    config["auto_map"] = {"AutoConfig": "configuration_my.MyCustomConfig"}
    path = _write_config(tmp_path, config)
    (tmp_path / "configuration_my.py").write_text(
        "from transformers import PretrainedConfig\n\n\n"
        "class MyCustomConfig(PretrainedConfig):\n"
        "    model_type = 'my_custom_lm'\n"
    )
    with pytest.raises(ValueError) as err:
        load_hf_config(path)
    assert "trust_remote_code=True" in str(err.value) and "--trust-remote-code" in str(err.value)

    trusted, _, _ = load_hf_config(path, trust_remote_code=True, hf_overrides={"hidden_size": 48})
    assert type(trusted).__name__ == "MyCustomConfig"
    assert trusted.hidden_size == 48


def test_neither_config_file_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as err:
        load_hf_config(str(tmp_path))
    message = str(err.value)
    assert "params.json" in message and "config.json" in message and "repo id" in message


def test_explicit_format_requires_its_file(tmp_path: Path) -> None:
    path = _write_config(tmp_path, _llama_dict())
    with pytest.raises(ValueError, match=r"params\.json \(Mistral format\)"):
        load_hf_config(path, config_format="mistral")
    with pytest.raises(ValueError, match="config_format must be one of"):
        load_hf_config(path, config_format="gguf")


def test_offline_uncached_repo_id_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ValueError) as err:
        load_hf_config("loraserve-tests/definitely-not-a-cached-model")
    assert "HF_HUB_OFFLINE" in str(err.value) and "not in the Hugging Face cache" in str(err.value)


def test_missing_local_path_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not an existing folder"):
        load_hf_config(str(tmp_path / "nope"))


def test_max_model_len_defaults_and_limits(tmp_path: Path) -> None:
    path = _write_config(tmp_path / "llama", _llama_dict())
    config = _model_config(path)
    assert config.max_model_len == 128
    assert _model_config(path, max_model_len=100).max_model_len == 100
    with pytest.raises(
        ValueError, match=r"max_model_len \(4096\) is greater than the derived max_model_len \(128"
    ):
        _model_config(path, max_model_len=4096)

    gpt2 = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=96, vocab_size=300).to_dict()
    gpt2["architectures"] = ["GPT2LMHeadModel"]
    assert _model_config(_write_config(tmp_path / "gpt2", gpt2)).max_model_len == 96

    yarn = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32, "rope_theta": 1e4}
    scaled = _write_config(tmp_path / "yarn", _llama_dict(rope_parameters=yarn))
    hf_config, _, _ = load_hf_config(scaled)
    assert derive_max_model_len(hf_config) == 128


def test_model_config_fields(tmp_path: Path) -> None:
    path = _write_config(tmp_path, _llama_dict())
    config = _model_config(path, seed=7)
    assert config.dtype == torch.float32
    assert config.tokenizer == path and config.served_model_name == path and config.model_path == path
    assert config.config_format == "hf" and config.seed == 7 and config.vocab_size == 300
    named = _model_config(path, tokenizer="some/tokenizer", served_model_name="tiny", dtype="bfloat16")
    assert (named.tokenizer, named.served_model_name, named.dtype) == (
        "some/tokenizer",
        "tiny",
        torch.bfloat16,
    )


def test_params_json_takes_precedence_and_maps_to_mistral_config(tmp_path: Path) -> None:
    _write_config(tmp_path, _llama_dict())
    params = {
        "dim": 32,
        "n_layers": 2,
        "head_dim": 8,
        "hidden_dim": 64,
        "n_heads": 4,
        "n_kv_heads": 2,
        "norm_eps": 1e-5,
        "vocab_size": 300,
        "rope_theta": 1e6,
        "max_seq_len": 512,
        "sliding_window": 16,
    }
    (tmp_path / "params.json").write_text(json.dumps(params))
    config = _model_config(str(tmp_path))
    hf = config.hf_config
    assert config.config_format == "mistral" and type(hf) is transformers.MistralConfig
    assert config.architectures == ("MistralForCausalLM",) and config.max_model_len == 512
    assert (hf.hidden_size, hf.num_hidden_layers, hf.intermediate_size) == (32, 2, 64)
    assert (hf.num_attention_heads, hf.num_key_value_heads, hf.head_dim) == (4, 2, 8)
    assert hf.rope_parameters["rope_theta"] == 1e6 and hf.sliding_window == 16 and hf.rms_norm_eps == 1e-5
    assert _model_config(str(tmp_path), config_format="hf").config_format == "hf"

    (tmp_path / "params.json").write_text(json.dumps({**params, "moe": {"num_experts": 8}}))
    with pytest.raises(ValueError, match="'moe'"):
        load_hf_config(str(tmp_path))
