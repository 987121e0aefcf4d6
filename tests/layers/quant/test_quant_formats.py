"""The torch twin of the block formats against gguf.quants (the layouts' source of truth), and the
on-load Q8_0 quantizer against gguf's."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from support.quant_blocks import random_quant_tensor

from loraserve.layers.quant.formats import (
    PANEL_TYPES,
    QUANT_TYPES,
    QuantTensor,
    file_blocks,
    panel_rows,
    quantize_q8_0,
    reference_linear,
    repack_panels,
    repack_rows,
)


@pytest.mark.parametrize("name", list(QUANT_TYPES))
def test_dequantize_matches_gguf(name: str) -> None:
    from gguf import GGMLQuantizationType, quants

    qtype = QUANT_TYPES[name]
    assert qtype.ggml_type == int(GGMLQuantizationType[name])
    assert (qtype.block_size, qtype.type_size) == quants.GGML_QUANT_SIZES[GGMLQuantizationType[name]]
    tensor = random_quant_tensor(qtype, 7, 512, seed=1)
    want = quants.dequantize(tensor.blocks.numpy(), GGMLQuantizationType[name])
    got = tensor.dequantize()
    assert got.shape == (7, 512)
    np.testing.assert_array_equal(got.numpy(), want)
    assert float(got.abs().sum()) > 0


@pytest.mark.parametrize("name", ["Q8_0", "Q4_0", "Q4_1"])
def test_gguf_quantized_weights_read_back(name: str) -> None:
    from gguf import GGMLQuantizationType, quants

    weight = torch.randn(5, 96, generator=torch.Generator().manual_seed(0))
    raw = quants.quantize(weight.numpy(), GGMLQuantizationType[name])
    tensor = QuantTensor(torch.from_numpy(raw), QUANT_TYPES[name], (5, 96))
    error = (tensor.dequantize() - weight).abs().max().item()
    assert error < {"Q8_0": 0.02, "Q4_0": 0.5, "Q4_1": 0.3}[name]


def test_quantize_q8_0_is_gguf_q8_0_and_within_half_a_step() -> None:
    from gguf import GGMLQuantizationType, quants

    weight = torch.randn(9, 160, generator=torch.Generator().manual_seed(3))
    mine = quantize_q8_0(weight)
    theirs = quants.dequantize(
        quants.quantize(weight.numpy(), GGMLQuantizationType.Q8_0), GGMLQuantizationType.Q8_0
    )
    step = weight.reshape(9, 5, 32).abs().amax(-1, keepdim=True) / 127
    assert bool(((mine.dequantize() - weight).reshape(9, 5, 32).abs() <= step * 0.51).all())
    assert (mine.dequantize().numpy() != theirs).mean() < 0.01  # only halves may round apart
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_0(torch.zeros(2, 40))


def test_quant_tensor_checks_its_shape_and_reference_is_float64() -> None:
    qtype = QUANT_TYPES["Q4_K"]
    with pytest.raises(ValueError, match="multiple of 256"):
        QuantTensor(torch.zeros(2, 144, dtype=torch.uint8), qtype, (2, 128))
    with pytest.raises(ValueError, match="uint8 blocks"):
        QuantTensor(torch.zeros(2, 100, dtype=torch.uint8), qtype, (2, 256))
    tensor = random_quant_tensor(qtype, 3, 256, seed=0)
    x = torch.randn(2, 256)
    y = reference_linear(x, tensor, torch.ones(3))
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, x.double() @ tensor.dequantize(torch.float64).T + 1)


@pytest.mark.parametrize("name", sorted(PANEL_TYPES))
def test_row_and_panel_layouts_hold_the_file_bytes(name: str) -> None:
    """Each layout is a permutation of the file's bytes (the same size; Q4_K's panels spread its 12
    packed scale bytes to 16), undone exactly from either other layout; panels hold 8 rows each, so a
    row count that is not a multiple of 8 keeps its layout."""
    qtype = QUANT_TYPES[name]
    tensor = random_quant_tensor(qtype, 24, 512 if qtype.block_size == 256 else 576, seed=1)
    rows, panels = repack_rows(tensor), repack_panels(tensor)
    nblocks = tensor.blocks.shape[1] // qtype.type_size
    assert panels.qtype == PANEL_TYPES[name]
    assert tuple(panels.blocks.shape) == (3, 8 * nblocks * PANEL_TYPES[name].type_size)
    if qtype.block_size == 32:
        assert sorted(panels.blocks.flatten().tolist()) == sorted(tensor.blocks.flatten().tolist())
    for layout in (rows, panels, repack_panels(rows), repack_rows(panels)):
        assert torch.equal(file_blocks(layout).blocks, tensor.blocks)
        assert torch.equal(layout.dequantize(), tensor.dequantize())
    picked = torch.tensor([23, 0, 9, 9])
    assert torch.equal(panel_rows(panels.blocks, panels.qtype, panels.shape, picked), tensor.blocks[picked])
    odd = random_quant_tensor(qtype, 12, qtype.block_size * 2, seed=2)
    assert repack_panels(odd) is odd
    with pytest.raises(ValueError, match="panels of 8 rows"):
        QuantTensor(torch.zeros(1, 8 * 34, dtype=torch.uint8), PANEL_TYPES["Q8_0"], (12, 32))
