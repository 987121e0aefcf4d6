"""Mistral's native checkpoint format: `params.json` -> HF MistralConfig, consolidated tensor names -> HF names.

Mistral-format q/k projections keep the interleaved rotary layout (rotating pairs (0,1), (2,3), ... of
each head), while HF Llama/Mistral code rotates the two halves of each head (`rotate_half`). Loading
them unchanged would give wrong outputs, so `wq`/`wk` rows are permuted per head, the same reordering
HF's conversion script applies, so the checkpoint runs under HF semantics.
"""

from __future__ import annotations

import json
import logging
import os
import re
from collections.abc import Iterator
from typing import Any

import torch

logger = logging.getLogger(__name__)

PARAMS_FILE = "params.json"
# Used when params.json gives no length; the same default as HF's conversion script.
DEFAULT_MAX_POSITION_EMBEDDINGS = 32768

_UNSUPPORTED_KEYS = {
    "moe": "mixture-of-experts",
    "vision_encoder": "vision encoder",
    "quantization": "quantized weights",
    "yarn": "YaRN rope scaling",
}
_TOP_LEVEL_NAMES = {"tok_embeddings": "model.embed_tokens", "norm": "model.norm", "output": "lm_head"}
_LAYER_NAMES = {
    "attention.wq": "self_attn.q_proj",
    "attention.wk": "self_attn.k_proj",
    "attention.wv": "self_attn.v_proj",
    "attention.wo": "self_attn.o_proj",
    "feed_forward.w1": "mlp.gate_proj",
    "feed_forward.w2": "mlp.down_proj",
    "feed_forward.w3": "mlp.up_proj",
    "attention_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_LAYER_RE = re.compile(r"^layers\.(\d+)\.(.+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^(\w+)\.(weight|bias)$")


def read_params(model_path: str) -> dict[str, Any]:
    path = os.path.join(model_path, PARAMS_FILE)
    try:
        with open(path, encoding="utf-8") as f:
            params = json.load(f)
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON: {e}") from e
    if not isinstance(params, dict):
        raise ValueError(f"{path} must hold a JSON object, got {type(params).__name__}.")
    return params


def _sliding_window(value: Any) -> int | None:
    if isinstance(value, list):
        windows = set(value)
        if len(windows) > 1:
            raise ValueError(f"params.json sliding_window {value!r}: per-layer windows are not supported.")
        value = windows.pop() if windows else None
    if value in (None, 0, "0", ""):
        return None
    return int(value)


def params_to_hf_config(params: dict[str, Any]) -> Any:
    """The HF MistralConfig equivalent to a Mistral `params.json` (architectures = MistralForCausalLM)."""
    from transformers import MistralConfig

    for key, what in _UNSUPPORTED_KEYS.items():
        if params.get(key):
            raise ValueError(
                f"params.json key {key!r} ({what}) is not supported for Mistral-format checkpoints."
            )
    missing = [key for key in ("dim", "n_layers", "n_heads", "hidden_dim", "vocab_size") if key not in params]
    if missing:
        raise ValueError(f"params.json is missing required keys {missing}.")
    num_heads = int(params["n_heads"])
    fields: dict[str, Any] = dict(
        hidden_size=int(params["dim"]),
        num_hidden_layers=int(params["n_layers"]),
        intermediate_size=int(params["hidden_dim"]),
        num_attention_heads=num_heads,
        num_key_value_heads=int(params.get("n_kv_heads") or num_heads),
        head_dim=int(params.get("head_dim") or int(params["dim"]) // num_heads),
        vocab_size=int(params["vocab_size"]),
        rms_norm_eps=float(params.get("norm_eps", 1e-5)),
        rope_theta=float(params.get("rope_theta", 10000.0)),
        max_position_embeddings=int(
            params.get("max_seq_len")
            or params.get("max_position_embeddings")
            or DEFAULT_MAX_POSITION_EMBEDDINGS
        ),
        sliding_window=_sliding_window(params.get("sliding_window")),
        tie_word_embeddings=bool(params.get("tied_embeddings", False)),
        architectures=["MistralForCausalLM"],
    )
    return MistralConfig(**fields)


def map_consolidated_name(name: str) -> str:
    """HF name of a consolidated tensor, e.g. layers.0.attention.wq.weight -> model.layers.0.self_attn.q_proj.weight."""
    layer = _LAYER_RE.match(name)
    if layer is not None and layer.group(2) in _LAYER_NAMES:
        index, module, param = layer.groups()
        return f"model.layers.{index}.{_LAYER_NAMES[module]}.{param}"
    top = _TOP_RE.match(name)
    if top is not None and top.group(1) in _TOP_LEVEL_NAMES:
        return f"{_TOP_LEVEL_NAMES[top.group(1)]}.{top.group(2)}"
    raise ValueError(f"Mistral-format tensor {name!r} has no Hugging Face equivalent in this loader.")


def permute_for_rotary(tensor: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Reorder each head's rows from interleaved pairs (0,1),(2,3).. to halves [0,2,4..|1,3,5..]."""
    rows = tensor.shape[0]
    if rows % num_heads or (rows // num_heads) % 2:
        raise ValueError(f"cannot permute a q/k tensor of shape {tuple(tensor.shape)} for {num_heads} heads.")
    head_dim = rows // num_heads
    rest = tensor.shape[1:]
    return tensor.reshape(num_heads, head_dim // 2, 2, *rest).transpose(1, 2).reshape(tensor.shape)


def consolidated_files(model_path: str) -> list[str]:
    files = sorted(
        name
        for name in os.listdir(model_path)
        if name.startswith("consolidated") and name.endswith(".safetensors")
    )
    if not files:
        raise ValueError(
            f"{model_path} has params.json (Mistral format) but no consolidated*.safetensors weights; "
            "pass config_format='hf' to load Hugging Face-format weights instead."
        )
    return [os.path.join(model_path, name) for name in files]


def map_consolidated_tensors(
    tensors: Iterator[tuple[str, torch.Tensor]], params: dict[str, Any]
) -> Iterator[tuple[str, torch.Tensor]]:
    """Rename consolidated tensors to HF names and permute q/k rows for HF's rotary layout."""
    num_heads = int(params["n_heads"])
    num_kv_heads = int(params.get("n_kv_heads") or num_heads)
    for name, tensor in tensors:
        hf_name = map_consolidated_name(name)
        if ".self_attn.q_proj." in hf_name:
            tensor = permute_for_rotary(tensor, num_heads)
        elif ".self_attn.k_proj." in hf_name:
            tensor = permute_for_rotary(tensor, num_kv_heads)
        yield hf_name, tensor
