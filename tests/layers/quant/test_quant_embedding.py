"""QuantEmbedding: a lookup over a block-quantized table equals the dequantized table's rows, in every
format, and keeps only the blocks."""

from __future__ import annotations

import pytest
import torch
from support.quant_blocks import random_quant_tensor

from loraserve.layers.quant.embedding import QuantEmbedding
from loraserve.layers.quant.formats import QUANT_TYPES, repack_panels, repack_rows


@pytest.mark.parametrize("layout", ["file", "rows", "panels"])
@pytest.mark.parametrize("name", sorted(QUANT_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_equals_the_dequantized_rows(name: str, dtype: torch.dtype, layout: str) -> None:
    """In the file's layout and in the kernel's (a tied LM head's table: rows, or panels of 8 rows)."""
    source = random_quant_tensor(QUANT_TYPES[name], 40, 512, seed=3)
    table = {"file": source, "rows": repack_rows(source), "panels": repack_panels(source)}[layout]
    embedding = QuantEmbedding(table, dtype)
    ids = torch.tensor([[0, 39, 7], [7, 12, 1]])
    rows = embedding(ids)
    assert rows.shape == (2, 3, 512) and rows.dtype == dtype
    assert torch.equal(rows, source.dequantize(torch.float64)[ids].to(dtype))
    assert not list(embedding.parameters())  # no dense copy
    assert embedding.blocks.data_ptr() == table.blocks.data_ptr()
