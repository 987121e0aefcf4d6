"""oneDNN-packed CPU linears compute what F.linear computes, and shared weights keep their dense copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraserve.layers.linear import Linear, pack_cpu_linears


@pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="oneDNN not built into torch")
def test_packed_matches_dense_and_shared_weight_survives() -> None:
    torch.manual_seed(0)
    plain = Linear(48, [40, 24], bias=True, dtype=torch.float32)
    tied = Linear(48, 100, dtype=torch.float32)
    embedding = nn.Embedding(100, 48)
    tied.weight = embedding.weight
    for layer in (plain, tied):
        layer.weight.data.normal_()
    plain.bias.data.normal_()
    dense_plain, dense_tied = plain.weight.detach().clone(), tied.weight.detach().clone()
    model = nn.ModuleList([plain, tied, embedding])
    assert pack_cpu_linears(model, shared={embedding.weight.data_ptr()}) == 2
    assert plain.weight.numel() == 0  # dense copy released
    assert torch.equal(tied.weight, dense_tied)  # still the embedding's weight
    for rows in (1, 7, 33):
        x = torch.randn(rows, 48)
        torch.testing.assert_close(plain(x), F.linear(x, dense_plain, plain.bias), atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(tied(x), F.linear(x, dense_tied), atol=1e-5, rtol=1e-5)
