"""Random block-quantized weights for tests: random bytes in every quant field, finite float16 scales,
so every bit of every format's layout is exercised (gguf.quants cannot quantize the K-quants)."""

from __future__ import annotations

import numpy as np
import torch

from loraserve.layers.quant.formats import QuantTensor, QuantType

# where each format keeps its float16 fields
F16_FIELDS = {"Q8_0": (0,), "Q4_0": (0,), "Q4_1": (0, 2), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def random_quant_tensor(qtype: QuantType, out: int, inp: int, seed: int, scale: float = 0.01) -> QuantTensor:
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(out, inp // qtype.block_size * qtype.type_size), dtype=np.uint8)
    blocks = raw.reshape(-1, qtype.type_size)
    for at in F16_FIELDS[qtype.name]:
        values = (rng.standard_normal(blocks.shape[0]) * scale).astype(np.float16)
        blocks[:, at : at + 2] = values.view(np.uint8).reshape(-1, 2)
    return QuantTensor(torch.from_numpy(raw), qtype, (out, inp))
