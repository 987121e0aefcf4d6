"""Tiny random GGUF files for tests, written with the `gguf` package: a 2-layer Llama with a byte-level
BPE (optionally with quantized tensors), and 2-layer Phi-3, Gemma-2 and Gemma-3 files.

The layout follows llama.cpp's (`blk.N.attn_q.weight`, `token_embd.weight`, tokenizer.ggml.*), so
transformers' GGUF reader, our converter's engine, reads them as it reads real files. HF models
written as GGUF are in gguf_from_hf.py, which shares this module's vocabulary and writer steps.
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


def byte_level_vocab() -> tuple[list[str], list[str]]:
    """The byte-level BPE's tokens (the special ones, the byte alphabet, the merged pieces) and merges."""
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = sorted(ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "o n", "Ġ a"]
    merged = [left + right for left, right in (merge.split(" ") for merge in merges)]
    return SPECIAL + alphabet + merged, merges


def add_byte_level_tokenizer(writer: Any, tokens: list[str], merges: list[str]) -> None:
    """The byte-level BPE's keys, as llama.cpp writes them (model "gpt2", tokens and their types, merges),
    and its bos / eos ids."""
    import gguf

    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types(
        [gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * (len(tokens) - 3)
    )
    writer.add_token_merges(merges)
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)


def write_out(writer: Any, path: str) -> str:
    """Write the header, the keys and the tensors, and close the file at `path`."""
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


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
    tokens, merges = byte_level_vocab()
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
    add_byte_level_tokenizer(writer, tokens, merges)
    writer.add_pad_token_id(0)
    writer.add_chat_template(CHAT_TEMPLATE)
    for index, (name, shape) in enumerate(_tensor_shapes(len(tokens), hidden, ffn)):
        values = (
            rng.standard_normal(shape) * (weight_std if len(shape) == 2 else 0.01) + (len(shape) == 1)
        ).astype(np.float32)
        raw_type = (raw_types or {}).get(name)
        if raw_type is None:
            writer.add_tensor(name, values)
        else:
            qtype = gguf.GGMLQuantizationType[raw_type]
            writer.add_tensor(
                name, _raw_bytes(values, qtype, seed * 1000 + index, weight_std), raw_dtype=qtype
            )
    return write_out(writer, path)


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
    tokens, merges = byte_level_vocab()
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
        add_byte_level_tokenizer(writer, tokens, merges)
    else:  # transformers reads Gemma files' vocabularies as sentencepiece ones
        tokens = _sentencepiecebyte_level_vocab()
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
    return write_out(writer, path)


def _sentencepiecebyte_level_vocab() -> list[str]:
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
    return len(byte_level_vocab()[0])
