"""Tiny GGUF files for tests, written with the `gguf` package: a 2-layer Llama with a byte-level BPE.

The layout follows llama.cpp's (`blk.N.attn_q.weight`, `token_embd.weight`, tokenizer.ggml.*), so
transformers' GGUF reader, our converter's engine, reads them as it reads real files.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from support.quant_blocks import random_quant_tensor

HIDDEN = 64
FFN = 128
NUM_LAYERS = 2
NUM_HEADS = 4
NUM_KV_HEADS = 2
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _vocab() -> tuple[list[str], list[str]]:
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "o n", "Ġ a"]
    merged = [left + right for left, right in (merge.split(" ") for merge in merges)]
    return SPECIAL + alphabet + merged, merges


def write_tiny_llama_gguf(
    path: str,
    seed: int = 0,
    arch: str = "llama",
    raw_types: dict[str, str] | None = None,
    weight_std: float = 0.02,
    hidden: int = HIDDEN,
    ffn: int = FFN,
    expert_count: int = 0,
) -> str:
    """A 2-layer Llama GGUF at `path` (random weights from `seed`); `raw_types` forces tensor types
    (the K-quants, which gguf cannot quantize, as random blocks of about `weight_std`); K-quants need
    `hidden` and `ffn` multiples of 256; `expert_count` states experts in the header (as a Mixtral file
    does; the tensors stay dense)."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, merges = _vocab()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(256)
    writer.add_embedding_length(hidden)
    writer.add_block_count(NUM_LAYERS)
    writer.add_feed_forward_length(ffn)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    if expert_count:
        writer.add_expert_count(expert_count)
        writer.add_expert_used_count(2)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    for index, (name, shape) in enumerate(_tensor_shapes(len(tokens), hidden, ffn)):
        values = (rng.standard_normal(shape) * (weight_std if len(shape) == 2 else 0.01) + (len(shape) == 1)).astype(
            np.float32
        )
        raw_type = (raw_types or {}).get(name)
        if raw_type is None:
            writer.add_tensor(name, values)
        else:
            qtype = gguf.GGMLQuantizationType[raw_type]
            writer.add_tensor(name, _raw_bytes(values, qtype, seed * 1000 + index, weight_std), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# typical |value| per unit of the float16 scale of random K-quant blocks (scale * sub-scale * quant)
_K_MAGNITUDE = {"Q4_K": 32 * 8, "Q5_K": 32 * 16, "Q6_K": 64 * 16}


def _raw_bytes(values: np.ndarray, qtype: object, seed: int, weight_std: float) -> np.ndarray:
    """Quantized bytes where the package can quantize, random K-quant blocks, else zero bytes."""
    import gguf

    from loraserve.layers.quant.formats import QUANT_TYPES

    name = getattr(qtype, "name", "")
    if name in _K_MAGNITUDE:
        scale = weight_std / _K_MAGNITUDE[name]
        return random_quant_tensor(QUANT_TYPES[name], *values.shape, seed=seed, scale=scale).blocks.numpy()
    try:
        return gguf.quantize(values, qtype)
    except NotImplementedError:
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        return np.zeros((values.shape[0], values.shape[1] // block_size * type_size), dtype=np.uint8)


def _tensor_shapes(vocab_size: int, hidden: int, ffn: int) -> list[tuple[str, tuple[int, ...]]]:
    head_dim = hidden // NUM_HEADS
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab_size, hidden))]
    for layer in range(NUM_LAYERS):
        prefix = f"blk.{layer}."
        shapes += [
            (prefix + "attn_norm.weight", (hidden,)),
            (prefix + "attn_q.weight", (hidden, hidden)),
            (prefix + "attn_k.weight", (NUM_KV_HEADS * head_dim, hidden)),
            (prefix + "attn_v.weight", (NUM_KV_HEADS * head_dim, hidden)),
            (prefix + "attn_output.weight", (hidden, hidden)),
            (prefix + "ffn_norm.weight", (hidden,)),
            (prefix + "ffn_gate.weight", (ffn, hidden)),
            (prefix + "ffn_up.weight", (ffn, hidden)),
            (prefix + "ffn_down.weight", (hidden, ffn)),
        ]
    shapes += [("output_norm.weight", (hidden,)), ("output.weight", (vocab_size, hidden))]
    return shapes


FAMILY_HEAD_DIM = {"phi3": HIDDEN // NUM_HEADS, "gemma2": 32, "gemma3": 32}


def write_tiny_family_gguf(path: str, arch: str, seed: int = 0, weight_std: float = 0.5) -> str:
    """A 2-layer GGUF of another family in llama.cpp's layout: "phi3" (fused attn_qkv, ffn_up holding
    gate and up), "gemma2" / "gemma3" (head_dim 32 != hidden / heads, a sliding window shorter than the
    prompts, sandwich norms; Gemma-3 with q/k norms). Same byte-level tokenizer as the Llama one."""
    import gguf

    rng = np.random.default_rng(seed)
    tokens, merges = _vocab()
    head_dim = FAMILY_HEAD_DIM[arch]
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(NUM_LAYERS)
    writer.add_feed_forward_length(FFN)
    writer.add_head_count(NUM_HEADS)
    writer.add_head_count_kv(NUM_KV_HEADS)
    writer.add_rope_freq_base(10000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    if arch != "phi3":
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)
        writer.add_sliding_window(4)
    if arch == "phi3":
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list(tokens)
        writer.add_token_types(
            [gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
        )
        writer.add_token_merges(merges)
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    else:  # transformers reads Gemma files' vocabularies as sentencepiece ones
        tokens = _sentencepiece_vocab()
        writer.add_tokenizer_model("llama")
        writer.add_token_list(tokens)
        writer.add_token_scores([0.0] * len(tokens))
        types = [gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.UNKNOWN] + [gguf.TokenType.BYTE] * 256
        writer.add_token_types(types + [gguf.TokenType.NORMAL] * (len(tokens) - len(types)))
        writer.add_bos_token_id(2)
        writer.add_eos_token_id(1)
        writer.add_unk_token_id(3)
    writer.add_vocab_size(len(tokens))
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    for name, shape in _family_shapes(arch, len(tokens), head_dim):
        # Random norm weights around 1 (the stored value; Gemma's reader takes 1 off) and weights large
        # enough that the tiny model's greedy tokens vary.
        std = weight_std if len(shape) == 2 else 0.3
        mean = float(len(shape) == 1)
        if arch != "phi3" and ".post_" in name:  # Gemma's sandwich norms scale the sublayers up against
            mean = 4.0  # the sqrt(hidden)-scaled embedding, as trained ones do (else the model echoes)
        if arch != "phi3" and name == "token_embd.weight":
            std = 0.1
        values = (rng.standard_normal(shape) * std + mean).astype(np.float32)
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _sentencepiece_vocab() -> list[str]:
    """<pad> <eos> <bos> <unk>, the 256 byte tokens, then pieces in merge order (best first)."""
    letters = [chr(c) for c in range(ord("a"), ord("z") + 1)]
    pieces = [
        "\u2581t",
        "he",
        "\u2581the",
        "\u2581c",
        "at",
        "\u2581cat",
        "in",
        "\u2581in",
        "\u2581h",
        "\u2581hat",
    ]
    return (
        ["<pad>", "<eos>", "<bos>", "<unk>"]
        + [f"<0x{b:02X}>" for b in range(256)]
        + pieces
        + letters
        + ["\u2581"]
    )


def _family_shapes(arch: str, vocab_size: int, head_dim: int) -> list[tuple[str, tuple[int, ...]]]:
    q, kv = NUM_HEADS * head_dim, NUM_KV_HEADS * head_dim
    shapes: list[tuple[str, tuple[int, ...]]] = [("token_embd.weight", (vocab_size, HIDDEN))]
    for layer in range(NUM_LAYERS):
        prefix = f"blk.{layer}."
        shapes.append((prefix + "attn_norm.weight", (HIDDEN,)))
        if arch == "phi3":
            shapes += [
                (prefix + "attn_qkv.weight", (q + 2 * kv, HIDDEN)),
                (prefix + "attn_output.weight", (HIDDEN, q)),
                (prefix + "ffn_norm.weight", (HIDDEN,)),
                (prefix + "ffn_up.weight", (2 * FFN, HIDDEN)),
                (prefix + "ffn_down.weight", (HIDDEN, FFN)),
            ]
            continue
        shapes += [
            (prefix + "attn_q.weight", (q, HIDDEN)),
            (prefix + "attn_k.weight", (kv, HIDDEN)),
            (prefix + "attn_v.weight", (kv, HIDDEN)),
            (prefix + "attn_output.weight", (HIDDEN, q)),
            (prefix + "post_attention_norm.weight", (HIDDEN,)),
            (prefix + "ffn_norm.weight", (HIDDEN,)),
            (prefix + "ffn_gate.weight", (FFN, HIDDEN)),
            (prefix + "ffn_up.weight", (FFN, HIDDEN)),
            (prefix + "ffn_down.weight", (HIDDEN, FFN)),
            (prefix + "post_ffw_norm.weight", (HIDDEN,)),
        ]
        if arch == "gemma3":
            shapes += [
                (prefix + "attn_q_norm.weight", (head_dim,)),
                (prefix + "attn_k_norm.weight", (head_dim,)),
            ]
    shapes.append(("output_norm.weight", (HIDDEN,)))
    if arch == "phi3":
        shapes.append(("output.weight", (vocab_size, HIDDEN)))
    return shapes


def byte_vocab_size() -> int:
    return len(_vocab()[0])


def write_phi3_gguf_from_hf(path: str, model: Any) -> str:
    """An HF Phi-3 model (vocab of `byte_vocab_size()`) as llama.cpp writes it: fused attn_qkv and
    ffn_up, LongRoPE as `rope_factors_long` / `rope_factors_short` tensors and the original length."""
    import gguf

    cfg = model.config
    rope = cfg.rope_parameters
    tokens, merges = _vocab()
    writer = gguf.GGUFWriter(path, "phi3")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_rope_freq_base(rope["rope_theta"])
    writer.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(rope["original_max_position_embeddings"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    names = {
        "input_layernorm": "attn_norm",
        "self_attn.qkv_proj": "attn_qkv",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for layer in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in names.items():
            writer.add_tensor(
                f"blk.{layer}.{gguf_name}.weight", state[f"model.layers.{layer}.{hf_name}.weight"]
            )
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    for kind in ("long", "short"):
        writer.add_tensor(f"rope_factors_{kind}.weight", np.array(rope[f"{kind}_factor"], dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def write_moe_gguf_from_hf(path: str, model: Any) -> str:
    """An HF Qwen2-MoE / Qwen3-MoE model (vocab of `byte_vocab_size()`) as llama.cpp writes it: stacked
    `ffn_{gate,up,down}_exps` [E, ...], the router as `ffn_gate_inp`, Qwen2-MoE's shared expert as
    `ffn_*_shexp` and its gate as `ffn_gate_inp_shexp`, Qwen3's q/k norms."""
    import gguf

    cfg = model.config
    arch = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[cfg.model_type]
    tokens, merges = _vocab()
    writer = gguf.GGUFWriter(path, arch)
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_key_length(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)
    writer.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    writer.add_expert_count(cfg.num_experts)
    writer.add_expert_used_count(cfg.num_experts_per_tok)
    writer.add_expert_weights_norm(bool(cfg.norm_topk_prob))
    if getattr(cfg, "shared_expert_intermediate_size", None):
        writer.add_expert_shared_feed_forward_length(cfg.shared_expert_intermediate_size)
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(0)
    state = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    writer.add_tensor("token_embd.weight", state["model.embed_tokens.weight"])
    for layer in range(cfg.num_hidden_layers):
        for hf_name, gguf_name in _moe_layer_names(state, f"model.layers.{layer}.").items():
            value = state[hf_name]
            if gguf_name == "ffn_gate_up_exps":  # transformers holds gate and up stacked: [E, 2I, H]
                half = value.shape[1] // 2
                writer.add_tensor(f"blk.{layer}.ffn_gate_exps.weight", np.ascontiguousarray(value[:, :half]))
                writer.add_tensor(f"blk.{layer}.ffn_up_exps.weight", np.ascontiguousarray(value[:, half:]))
                continue
            if gguf_name == "ffn_gate_inp_shexp":  # llama.cpp keeps the shared expert's gate as [hidden]
                value = value.reshape(-1)
            kind = "bias" if hf_name.endswith(".bias") else "weight"
            writer.add_tensor(f"blk.{layer}.{gguf_name}.{kind}", value)
    writer.add_tensor("output_norm.weight", state["model.norm.weight"])
    writer.add_tensor("output.weight", state["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def _moe_layer_names(state: dict[str, Any], prefix: str) -> dict[str, str]:
    names = {
        "input_layernorm.weight": "attn_norm",
        "self_attn.q_proj.weight": "attn_q",
        "self_attn.k_proj.weight": "attn_k",
        "self_attn.v_proj.weight": "attn_v",
        "self_attn.q_proj.bias": "attn_q",
        "self_attn.k_proj.bias": "attn_k",
        "self_attn.v_proj.bias": "attn_v",
        "self_attn.o_proj.weight": "attn_output",
        "self_attn.q_norm.weight": "attn_q_norm",
        "self_attn.k_norm.weight": "attn_k_norm",
        "post_attention_layernorm.weight": "ffn_norm",
        "mlp.gate.weight": "ffn_gate_inp",
        "mlp.experts.gate_up_proj": "ffn_gate_up_exps",
        "mlp.experts.down_proj": "ffn_down_exps",
        "mlp.shared_expert.gate_proj.weight": "ffn_gate_shexp",
        "mlp.shared_expert.up_proj.weight": "ffn_up_shexp",
        "mlp.shared_expert.down_proj.weight": "ffn_down_shexp",
        "mlp.shared_expert_gate.weight": "ffn_gate_inp_shexp",
        "mlp.gate_proj.weight": "ffn_gate",  # a dense layer (Qwen2-MoE's mlp_only_layers)
        "mlp.up_proj.weight": "ffn_up",
        "mlp.down_proj.weight": "ffn_down",
    }
    return {prefix + suffix: name for suffix, name in names.items() if prefix + suffix in state}
