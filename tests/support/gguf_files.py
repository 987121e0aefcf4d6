"""Tiny GGUF files for tests, written with the `gguf` package: a 2-layer Llama with a byte-level BPE.

The layout follows llama.cpp's (`blk.N.attn_q.weight`, `token_embd.weight`, tokenizer.ggml.*), so
transformers' GGUF reader, our converter's engine, reads them as it reads real files.
"""

from __future__ import annotations

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
) -> str:
    """A 2-layer Llama GGUF at `path` (random weights from `seed`); `raw_types` forces tensor types
    (the K-quants, which gguf cannot quantize, as random blocks of about `weight_std`); K-quants need
    `hidden` and `ffn` multiples of 256."""
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
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * len(SPECIAL) + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
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
