"""Llama-3.2-1B- and Llama-3.1-8B-shaped GGUFs with random weights, as Q8_0 and as Q4_K_M, for the
benchmarks beside llama.cpp (built once, cached under `<cache_root>/bench-llama1b`).

Llama-3.2-1B's shape: 16 layers, hidden 2048, 32 heads over 8 KV heads of 64, MLP 8192, its 128256-
token vocabulary with tied embeddings; Llama-3.1-8B's: 32 layers, hidden 4096, 32 heads over 8 KV heads
of 128, MLP 14336, the same vocabulary with an untied output (Q6_K in Q4_K_M, its token embedding Q4_K);
rope base 500000 (the llama3 rope scaling left out: it changes no step's cost). The tokenizer is a byte-level BPE padded to 128256 tokens (tokens past the bytes are
unreachable by merges: prompts are token ids). Q8_0 weights are random normals (std 0.02) quantized by
`quantize_q8_0`; the K-quants, which the `gguf` package cannot quantize, are random blocks of about
that size, in llama.cpp's Q4_K_M mix: Q4_K everywhere but Q6_K for the tied embedding/LM head and for
attn_v and ffn_down in the first and last eighth of the layers and every third one between
(llama.cpp's `use_more_bits`). Written tensor by tensor, so memory holds one tensor at a time.
"""

from __future__ import annotations

import os
from collections.abc import Iterator

import numpy as np
import torch

from loraserve import envs
from loraserve.layers.quant.formats import quantize_q8_0

LLAMA_1B = dict(layers=16, hidden=2048, heads=32, kv_heads=8, ffn=8192, vocab=128256, tied=True)
LLAMA_8B = dict(layers=32, hidden=4096, heads=32, kv_heads=8, ffn=14336, vocab=128256, tied=False)
SHAPES = {"1b": LLAMA_1B, "8b": LLAMA_8B}
KINDS = ("Q8_0", "Q4_K_M")
_SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|eot_id|>"]
_STD = 0.02
_SIZES = {"Q4_K": (256, 144), "Q6_K": (256, 210)}


def gguf_root() -> str:
    return os.path.join(envs.cache_root(), "bench-llama1b")


def _vocab(size: int) -> tuple[list[str], list[str]]:
    from tokenizers.pre_tokenizers import ByteLevel

    merges = ["Ġ t", "h e", "Ġt he", "i n", "e r", "a n", "o n", "Ġ a"]
    tokens = _SPECIAL + sorted(ByteLevel.alphabet()) + [a + b for a, b in (m.split(" ") for m in merges)]
    tokens += [f"<r{i}>" for i in range(size - len(tokens))]
    return tokens, merges


def _shapes(c: dict) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(GGUF name, shape [out, in] as numpy holds it) of every tensor, in file order."""
    head_dim = c["hidden"] // c["heads"]
    yield "token_embd.weight", (c["vocab"], c["hidden"])
    for i in range(c["layers"]):
        for name, shape in (
            ("attn_norm", (c["hidden"],)),
            ("attn_q", (c["hidden"], c["hidden"])),
            ("attn_k", (c["kv_heads"] * head_dim, c["hidden"])),
            ("attn_v", (c["kv_heads"] * head_dim, c["hidden"])),
            ("attn_output", (c["hidden"], c["hidden"])),
            ("ffn_norm", (c["hidden"],)),
            ("ffn_gate", (c["ffn"], c["hidden"])),
            ("ffn_up", (c["ffn"], c["hidden"])),
            ("ffn_down", (c["hidden"], c["ffn"])),
        ):
            yield f"blk.{i}.{name}.weight", shape
    yield "output_norm.weight", (c["hidden"],)
    if not c["tied"]:
        yield "output.weight", (c["vocab"], c["hidden"])


def _more_bits(layer: int, layers: int) -> bool:
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def q4_k_m_type(name: str, c: dict) -> str:
    """The format llama.cpp's Q4_K_M gives tensor `name` of model `c`."""
    if name == "output.weight" or (name == "token_embd.weight" and c["tied"]):  # the LM head: Q6_K
        return "Q6_K"
    if name.endswith(("attn_v.weight", "ffn_down.weight")):
        layer = int(name.split(".")[1])
        return "Q6_K" if _more_bits(layer, c["layers"]) else "Q4_K"
    return "Q4_K"


def _random_k_blocks(qtype: str, shape: tuple[int, int], rng: np.random.Generator) -> np.ndarray:
    """Random `qtype` blocks [out, row bytes] whose values are about _STD in size."""
    block, size = _SIZES[qtype]
    out, inp = shape
    raw = rng.integers(0, 256, size=(out * inp // block, size), dtype=np.uint8)
    if qtype == "Q4_K":  # d, dmin (fp16), then 12 scale bytes and 128 of nibbles
        scale = np.float16(_STD / (32 * 8))
        raw[:, 0:2] = np.frombuffer(scale.tobytes(), dtype=np.uint8)
        raw[:, 2:4] = np.frombuffer(np.float16(_STD / 32).tobytes(), dtype=np.uint8)
    else:  # Q6_K: 128 low bytes, 64 high bytes, 16 int8 scales, d (fp16) last
        raw[:, 192:208] = rng.integers(1, 32, size=(raw.shape[0], 16), dtype=np.uint8)
        raw[:, 208:210] = np.frombuffer(np.float16(_STD / (32 * 16)).tobytes(), dtype=np.uint8)
    return raw.reshape(out, -1)


def _tensor(name: str, shape: tuple[int, ...], kind: str, seed: int, c: dict) -> tuple[np.ndarray, object | None]:
    """(data, raw GGML type or None for float32) of one tensor."""
    import gguf

    rng = np.random.default_rng(seed)
    if len(shape) == 1:
        return np.ones(shape, dtype=np.float32), None
    if kind == "Q8_0":
        values = torch.from_numpy(rng.standard_normal(shape, dtype=np.float32) * _STD)
        return quantize_q8_0(values).blocks.numpy(), gguf.GGMLQuantizationType.Q8_0
    qtype = q4_k_m_type(name, c)
    return _random_k_blocks(qtype, (shape[0], shape[1]), rng), gguf.GGMLQuantizationType[qtype]


def build_llama_gguf(kind: str, size: str = "1b") -> str:
    """The path of the `size` ("1b" or "8b") GGUF in `kind` ("Q8_0" or "Q4_K_M"), written once."""
    import gguf

    if kind not in KINDS or size not in SHAPES:
        raise ValueError(f"kind must be one of {KINDS} and size one of {tuple(SHAPES)}, got {kind!r}, {size!r}")
    name = {"1b": "llama-3.2-1b", "8b": "llama-3.1-8b"}[size]
    path = os.path.join(gguf_root(), f"{name}-random.{kind}.gguf")
    if os.path.isfile(path):
        return path
    os.makedirs(gguf_root(), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"
    c = SHAPES[size]
    writer = gguf.GGUFWriter(tmp, "llama")
    writer.add_context_length(8192)
    writer.add_embedding_length(c["hidden"])
    writer.add_block_count(c["layers"])
    writer.add_feed_forward_length(c["ffn"])
    writer.add_head_count(c["heads"])
    writer.add_head_count_kv(c["kv_heads"])
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if kind == "Q8_0" else gguf.LlamaFileType.MOSTLY_Q4_K_M)
    tokens, merges = _vocab(c["vocab"])
    writer.add_vocab_size(len(tokens))
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL] * 3 + [gguf.TokenType.NORMAL] * (len(tokens) - 3))
    writer.add_token_merges(merges)
    writer.add_bos_token_id(0)
    writer.add_eos_token_id(1)
    shapes = list(_shapes(c))
    for name, shape in shapes:  # the infos first: the header precedes the data
        if len(shape) == 1:
            writer.add_tensor_info(name, shape, np.dtype(np.float32), shape[0] * 4)
            continue
        qtype = "Q8_0" if kind == "Q8_0" else q4_k_m_type(name, c)
        block, size = _SIZES.get(qtype, (32, 34))
        byte_shape = (shape[0], shape[1] // block * size)
        raw = gguf.GGMLQuantizationType[qtype]
        writer.add_tensor_info(name, byte_shape, np.dtype(np.uint8), byte_shape[0] * byte_shape[1], raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for seed, (name, shape) in enumerate(shapes):
        writer.write_tensor_data(_tensor(name, shape, kind, seed, c)[0])
    writer.close()
    os.replace(tmp, path)
    return path


if __name__ == "__main__":
    for kind in KINDS:
        print(build_llama_gguf(kind))
    print(build_llama_gguf("Q4_K_M", "8b"))
