"""QuantEmbedding: a lookup over a block-quantized table equals the dequantized table's rows, in every
format and layout, on every build of the kernel that gathers them and on the torch twin, and keeps only
the blocks."""

from __future__ import annotations

import pytest
import torch
from support.quant_blocks import random_quant_tensor

from loraserve.layers.quant import kernel as qk
from loraserve.layers.quant.embedding import QuantEmbedding
from loraserve.layers.quant.formats import QUANT_TYPES, repack_panels, repack_rows


@pytest.mark.parametrize("layout", ["file", "rows", "panels"])
@pytest.mark.parametrize("name", sorted(QUANT_TYPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_lookup_equals_the_dequantized_rows(build: str, name: str, dtype: torch.dtype, layout: str) -> None:
    """In the file's layout and in the kernel's (a tied LM head's table: rows, or panels of 8 rows)."""
    _check_lookup(name, dtype, layout)


@pytest.mark.parametrize("layout", ["file", "rows", "panels"])
@pytest.mark.parametrize("name", sorted(QUANT_TYPES))
def test_twin_lookup_equals_the_dequantized_rows(name: str, layout: str) -> None:
    """Without a build the torch twin gathers the same rows."""
    own = qk.kernel_library()
    qk.use_library(None)
    try:
        _check_lookup(name, torch.bfloat16, layout)
    finally:
        qk.use_library(own)


@pytest.mark.parametrize("bad", [-1, 40])
@pytest.mark.parametrize("layout", ["file", "panels"])
def test_an_id_outside_the_table_raises_index_error(bad: int, layout: str) -> None:
    source = random_quant_tensor(QUANT_TYPES["Q4_K"], 40, 256, seed=1)
    embedding = QuantEmbedding(source if layout == "file" else repack_panels(source), torch.float32)
    with pytest.raises(IndexError):
        embedding(torch.tensor([3, bad]))


def _check_lookup(name: str, dtype: torch.dtype, layout: str) -> None:
    source = random_quant_tensor(QUANT_TYPES[name], 40, 512, seed=3)
    table = {"file": source, "rows": repack_rows(source), "panels": repack_panels(source)}[layout]
    embedding = QuantEmbedding(table, dtype)
    ids = torch.tensor([[0, 39, 7], [7, 12, 1]])
    rows = embedding(ids)
    assert rows.shape == (2, 3, 512) and rows.dtype == dtype
    assert torch.equal(rows, source.dequantize(torch.float64)[ids].to(dtype))
    many = torch.randint(0, 40, (200,), generator=torch.Generator().manual_seed(0))  # a prompt's rows: threads
    assert torch.equal(embedding(many), source.dequantize(torch.float64)[many].to(dtype))
    assert not list(embedding.parameters())  # no dense copy
    assert embedding.blocks.data_ptr() == table.blocks.data_ptr()
