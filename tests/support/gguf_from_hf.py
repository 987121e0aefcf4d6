"""HF models written as GGUF files the way llama.cpp's converter writes them: Phi-3 (fused attn_qkv and
ffn_up, LongRoPE factors as tensors) and Qwen2-MoE / Qwen3-MoE (stacked experts, router, shared expert).

The models must use the byte-level vocabulary of gguf_files.py (`byte_vocab_size()` tokens), whose
tokenizer keys these files carry.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from support.gguf_files import add_byte_level_tokenizer, byte_level_vocab, write_out


def write_phi3_gguf_from_hf(path: str, model: Any) -> str:
    """An HF Phi-3 model (vocab of `byte_vocab_size()`) as llama.cpp writes it: fused attn_qkv and
    ffn_up, LongRoPE as `rope_factors_long` / `rope_factors_short` tensors and the original length."""
    import gguf

    cfg = model.config
    rope = cfg.rope_parameters
    tokens, merges = byte_level_vocab()
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
    add_byte_level_tokenizer(writer, tokens, merges)
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
    return write_out(writer, path)


def write_moe_gguf_from_hf(path: str, model: Any) -> str:
    """An HF Qwen2-MoE / Qwen3-MoE model (vocab of `byte_vocab_size()`) as llama.cpp writes it: stacked
    `ffn_{gate,up,down}_exps` [E, ...], the router as `ffn_gate_inp`, Qwen2-MoE's shared expert as
    `ffn_*_shexp` and its gate as `ffn_gate_inp_shexp`, Qwen3's q/k norms."""
    import gguf

    cfg = model.config
    arch = {"qwen2_moe": "qwen2moe", "qwen3_moe": "qwen3moe"}[cfg.model_type]
    tokens, merges = byte_level_vocab()
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
    add_byte_level_tokenizer(writer, tokens, merges)
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
    return write_out(writer, path)


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
