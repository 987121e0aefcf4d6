"""Weight iteration: sharded safetensors, pickle checkpoints (and refusing code-running pickles), and the
Mistral consolidated format, whose renamed and rotary-permuted tensors must reproduce the HF model."""

from __future__ import annotations

import json
import logging
import pathlib
from pathlib import Path

import pytest
import torch
import transformers
from safetensors.torch import save_file
from support.mini_llama import MINI_LLAMA

from loraserve.batch.attention_metadata import build_attention_metadata
from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.model_loader.config import create_model_config, load_hf_config
from loraserve.model_loader.loader import get_model
from loraserve.model_loader.weights import iterate_weights


def _tiny_llama(seed: int = 0) -> transformers.LlamaForCausalLM:
    torch.manual_seed(seed)
    config = transformers.LlamaConfig(**MINI_LLAMA, rope_theta=10000.0)
    return transformers.LlamaForCausalLM(config).eval()


def _assert_same_tensors(loaded: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(loaded) == sorted(expected)
    for name, tensor in expected.items():
        torch.testing.assert_close(loaded[name], tensor, rtol=0, atol=0)


def test_sharded_safetensors_reads_only_indexed_files(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    model = _tiny_llama()
    model.save_pretrained(tmp_path, max_shard_size="40KB")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    num_files = len(set(index["weight_map"].values()))
    assert num_files > 1
    # A stray file next to the shards (e.g. an old export) is not part of the checkpoint.
    save_file({"stray.weight": torch.zeros(2)}, str(tmp_path / "stray.safetensors"))
    with caplog.at_level(logging.INFO, logger="loraserve.model_loader.weights"):
        loaded = dict(iterate_weights(str(tmp_path), "hf"))
    _assert_same_tensors(loaded, model.state_dict())
    assert f"Loading weights: {num_files}/{num_files} files" in caplog.text


def test_unindexed_safetensors_files_are_all_read(tmp_path: Path) -> None:
    state = _tiny_llama().state_dict()
    names = sorted(state)
    save_file({n: state[n].contiguous() for n in names[:5]}, str(tmp_path / "part-a.safetensors"))
    save_file({n: state[n].contiguous() for n in names[5:]}, str(tmp_path / "part-b.safetensors"))
    _assert_same_tensors(dict(iterate_weights(str(tmp_path), "hf")), state)


def test_pickle_checkpoint_loads_with_weights_only(tmp_path: Path) -> None:
    state = _tiny_llama().state_dict()
    torch.save(state, tmp_path / "pytorch_model.bin")
    torch.save({"ignored": torch.ones(1)}, tmp_path / "optimizer.pt")  # trainer state, not weights
    _assert_same_tensors(dict(iterate_weights(str(tmp_path), "hf")), state)


class _Payload:
    """Unpickling this calls Path.touch: the harmless stand-in for a checkpoint that runs code."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[object, ...]]:
        return pathlib.Path.touch, (self.marker,)


def test_malicious_pickle_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "code-ran"
    torch.save({"weight": torch.zeros(2), "payload": _Payload(marker)}, tmp_path / "pytorch_model.bin")
    with pytest.raises(ValueError, match="Refusing to load .*pytorch_model.bin"):
        list(iterate_weights(str(tmp_path), "hf"))
    assert not marker.exists()


def test_folder_without_weights_is_a_clear_error(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match="No weights found"):
        list(iterate_weights(str(tmp_path), "hf"))


def _inverse_rotary_permutation(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """HF half-split rows of each head back to Mistral's interleaved pairs (the oracle's own inverse)."""
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, -1).transpose(1, 2).reshape(weight.shape)


def _to_consolidated(
    state: dict[str, torch.Tensor], num_heads: int, num_kv_heads: int
) -> dict[str, torch.Tensor]:
    layer_names = {
        "self_attn.q_proj": "attention.wq",
        "self_attn.k_proj": "attention.wk",
        "self_attn.v_proj": "attention.wv",
        "self_attn.o_proj": "attention.wo",
        "mlp.gate_proj": "feed_forward.w1",
        "mlp.down_proj": "feed_forward.w2",
        "mlp.up_proj": "feed_forward.w3",
        "input_layernorm": "attention_norm",
        "post_attention_layernorm": "ffn_norm",
    }
    top_names = {
        "model.embed_tokens.weight": "tok_embeddings.weight",
        "model.norm.weight": "norm.weight",
        "lm_head.weight": "output.weight",
    }
    out = {}
    for name, tensor in state.items():
        if name in top_names:
            out[top_names[name]] = tensor
            continue
        _, _, index, *module, param = name.split(".")
        module_name = ".".join(module)
        if module_name == "self_attn.q_proj":
            tensor = _inverse_rotary_permutation(tensor, num_heads)
        elif module_name == "self_attn.k_proj":
            tensor = _inverse_rotary_permutation(tensor, num_kv_heads)
        out[f"layers.{index}.{layer_names[module_name]}.{param}"] = tensor.contiguous()
    return out


def _write_mistral_folder(folder: Path, model: transformers.LlamaForCausalLM) -> None:
    cfg = model.config
    params = {
        "dim": cfg.hidden_size,
        "n_layers": cfg.num_hidden_layers,
        "head_dim": cfg.head_dim,
        "hidden_dim": cfg.intermediate_size,
        "n_heads": cfg.num_attention_heads,
        "n_kv_heads": cfg.num_key_value_heads,
        "norm_eps": cfg.rms_norm_eps,
        "vocab_size": cfg.vocab_size,
        "rope_theta": cfg.rope_parameters["rope_theta"],
        "max_seq_len": cfg.max_position_embeddings,
    }
    (folder / "params.json").write_text(json.dumps(params))
    consolidated = _to_consolidated(model.state_dict(), cfg.num_attention_heads, cfg.num_key_value_heads)
    save_file(consolidated, str(folder / "consolidated.safetensors"))


def test_mistral_format_loads_to_the_same_logits_as_the_hf_model(tmp_path: Path) -> None:
    llama = _tiny_llama(seed=3)
    _write_mistral_folder(tmp_path, llama)
    # HF-format files next to the consolidated ones (as in Mistral's repos) must not be mixed in.
    llama.save_pretrained(tmp_path)

    config, model_path, fmt = load_hf_config(str(tmp_path))
    assert fmt == "mistral" and type(config) is transformers.MistralConfig
    mistral = transformers.MistralForCausalLM(config).eval()
    weights = dict(iterate_weights(model_path, fmt))
    mistral.load_state_dict(weights, strict=True)

    input_ids = torch.randint(0, config.vocab_size, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = llama(input_ids=input_ids).logits
        torch.testing.assert_close(mistral(input_ids=input_ids).logits, expected, rtol=1e-5, atol=1e-5)

        # Without the rotary permutation the renamed weights give a different model.
        raw = transformers.MistralForCausalLM(config).eval()
        raw.load_state_dict(_unpermuted_qk(weights, tmp_path), strict=True)
        assert not torch.allclose(raw(input_ids=input_ids).logits, expected, atol=1e-3)


def _unpermuted_qk(weights: dict[str, torch.Tensor], folder: Path) -> dict[str, torch.Tensor]:
    """Mapped weights, but q/k taken straight from the consolidated file (renamed, not permuted)."""
    from safetensors.torch import load_file

    consolidated = load_file(str(folder / "consolidated.safetensors"))
    raw = dict(weights)
    for index in (0, 1):
        raw[f"model.layers.{index}.self_attn.q_proj.weight"] = consolidated[
            f"layers.{index}.attention.wq.weight"
        ]
        raw[f"model.layers.{index}.self_attn.k_proj.weight"] = consolidated[
            f"layers.{index}.attention.wk.weight"
        ]
    return raw


def test_mistral_unknown_tensor_name_is_a_clear_error(tmp_path: Path) -> None:
    _write_mistral_folder(tmp_path, _tiny_llama())
    save_file({"vision_encoder.patch.weight": torch.zeros(2)}, str(tmp_path / "consolidated.safetensors"))
    with pytest.raises(ValueError, match="'vision_encoder.patch.weight' has no Hugging Face equivalent"):
        list(iterate_weights(str(tmp_path), "mistral"))


@pytest.mark.parametrize("model_impl", ["auto", "transformers"])
def test_mistral_format_through_get_model(tmp_path: Path, model_impl: str) -> None:
    llama = _tiny_llama(seed=5)
    _write_mistral_folder(tmp_path, llama)
    model_config = create_model_config(str(tmp_path), dtype="float32", device="cpu", model_impl=model_impl)
    model = get_model(model_config, "cpu")
    assert model.is_native == (model_impl == "auto")
    spec = model.kv_cache_spec()
    shape = (16, spec.num_kv_heads, spec.head_dim)
    kv_caches = [KVCache(torch.zeros(shape), torch.zeros(shape)) for _ in range(spec.num_layers)]
    input_ids = torch.randint(0, 300, (9,), generator=torch.Generator().manual_seed(2))
    meta = build_attention_metadata([9], [9], [[2, 0, 3]], 4, torch.device("cpu"))
    with torch.inference_mode():
        hidden = model(input_ids, torch.arange(9), kv_caches, ForwardBatch(attn=meta))
        logits = model.compute_logits(hidden)
        expected = llama(input_ids=input_ids[None]).logits[0]
    torch.testing.assert_close(logits, expected, rtol=1e-4, atol=1e-4)


def test_get_model_scopes_the_default_dtype(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    _tiny_llama().save_pretrained(tmp_path)
    model_config = create_model_config(
        str(tmp_path), dtype="bfloat16", device="cpu", model_impl="transformers"
    )
    with caplog.at_level(logging.INFO, logger="loraserve.model_loader.loader"):
        model = get_model(model_config, "cpu")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert torch.get_default_dtype() == torch.float32
    assert not model.training
    assert "Loaded " in caplog.text and "TransformersForCausalLM" in caplog.text
