"""A token embedding kept in its GGUF block format: a lookup dequantizes only the rows it gathers.

A quantized file's embedding table is often the largest tensor (a 128k vocabulary at 2048 wide is
525 MB in bf16, 215 MB in Q6_K); kept as blocks it costs its file bytes, and a tied LM head runs on the
same blocks, so the model holds the table once. Rows are dequantized by the torch twin
(`formats.dequantize`): a step gathers one row per token, a few microseconds of work beside its linears.
"""

from __future__ import annotations

import torch
from torch import nn

from loraserve.layers.quant.formats import QUANT_TYPES, QuantTensor, dequantize, panel_rows


class QuantEmbedding(nn.Module):
    """nn.Embedding's lookup over a QuantTensor [vocab, dim]; rows come out in `dtype`."""

    blocks: torch.Tensor

    def __init__(self, tensor: QuantTensor, dtype: torch.dtype) -> None:
        super().__init__()
        self.qtype = tensor.qtype
        self.num_embeddings, self.embedding_dim = tensor.shape
        self.dtype = dtype
        self.register_buffer("blocks", tensor.blocks.contiguous(), persistent=False)

    @property
    def tensor(self) -> QuantTensor:
        return QuantTensor(self.blocks, self.qtype, (self.num_embeddings, self.embedding_dim))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        flat = input_ids.reshape(-1)
        shape = (flat.numel(), self.embedding_dim)
        if self.qtype.panels_of is not None:  # a tied LM head's panels: each row spread over its panel
            rows = panel_rows(self.blocks, self.qtype, (self.num_embeddings, self.embedding_dim), flat)
            values = dequantize(rows, QUANT_TYPES[self.qtype.source], shape).to(self.dtype)
        else:
            values = dequantize(self.blocks.index_select(0, flat), self.qtype, shape).to(self.dtype)
        return values.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name}"
