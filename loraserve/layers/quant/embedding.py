"""A token embedding kept in its GGUF block format: a lookup dequantizes only the rows it gathers.

A quantized file's embedding table is often the largest tensor (a 128k vocabulary at 2048 wide is
525 MB in bf16, 215 MB in Q6_K); kept as blocks it costs its file bytes, and a tied LM head runs on the
same blocks, so the model holds the table once. The C kernel gathers and dequantizes the rows a step
reads (`kernel.embedding_rows`: a few microseconds a token, where the torch twin `formats.dequantize`
took ~0.5 ms of Python and torch calls for one row of a Q6_K table in panels); the twin serves where it
is not built.
"""

from __future__ import annotations

import torch
from torch import nn

from loraserve.layers.quant import kernel as quant_kernel
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
        gathered = quant_kernel.embedding_rows(self.tensor, flat.to(torch.int64).contiguous(), self.dtype)
        if gathered is not None:
            return gathered.view(*input_ids.shape, self.embedding_dim)
        if flat.numel() and (int(flat.min()) < 0 or int(flat.max()) >= self.num_embeddings):
            raise IndexError("index out of range in self")  # (a panel's row index would wrap)
        if self.qtype.panels_of is not None:  # a tied LM head's panels: each row spread over its panel
            rows = panel_rows(self.blocks, self.qtype, (self.num_embeddings, self.embedding_dim), flat)
            values = dequantize(rows, QUANT_TYPES[self.qtype.source], shape).to(self.dtype)
        else:
            values = dequantize(self.blocks.index_select(0, flat), self.qtype, shape).to(self.dtype)
        return values.view(*input_ids.shape, self.embedding_dim)

    def extra_repr(self) -> str:
        return f"{self.num_embeddings}, {self.embedding_dim}, {self.qtype.name}"
