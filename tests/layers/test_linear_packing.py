"""Packed CPU linears (the C linear kernel where it serves the dtype, else oneDNN; both are run here)
compute what F.linear computes, and shared weights keep their dense copy."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from loraserve.layers.linear import Linear, pack_cpu_linears, packed_rows

# Each test runs with the C linear kernel as built here, and again without it (oneDNN packs).
pytestmark = pytest.mark.usefixtures("linear_backend")


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


def test_row_buckets_cover_and_stay_few() -> None:
    buckets = {packed_rows(n) for n in range(1, 4097)}
    assert all(packed_rows(n) >= n for n in range(1, 4097))
    assert all(packed_rows(n) <= max(16, 2 * n) for n in range(1, 65))  # small batches: at most double
    assert all(packed_rows(n) - n < 32 for n in range(65, 4097))  # larger ones: under 32 extra rows
    assert len(buckets) <= 3 + 4096 // 32  # every shape a 4k-token step could need


@pytest.mark.parametrize("num_rows", [1, 15, 16, 17, 33, 64, 65, 100, 2048])
def test_packed_linear_matches_dense(num_rows: int) -> None:
    torch.manual_seed(num_rows)
    layer = Linear(96, [40, 24], bias=True, dtype=torch.float32)
    with torch.no_grad():
        layer.weight.normal_()
        layer.bias.normal_()  # type: ignore[union-attr]
    weight, bias = layer.weight.detach().clone(), layer.bias.detach().clone()  # type: ignore[union-attr]
    if pack_cpu_linears(layer) == 0:
        pytest.skip("oneDNN cannot pack on this CPU")
    x = torch.randn(num_rows, 96)
    torch.testing.assert_close(layer(x), F.linear(x, weight, bias), rtol=1e-4, atol=1e-4)
    x3 = torch.randn(2, num_rows, 96)  # leading dims other than tokens keep their shape
    torch.testing.assert_close(layer(x3), F.linear(x3, weight, bias), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("flags", [{"avx512f", "avx512_bf16", "amx_bf16"}, {"avx512f", "avx512_bf16"}])
@pytest.mark.parametrize("setting", [None, "1", "0"])
def test_bf16_on_amx_keeps_onednn_unless_the_kernel_is_asked_for(
    flags: set[str], setting: str | None, monkeypatch: pytest.MonkeyPatch
) -> None:
    from loraserve.layers import gemm_cpu

    if setting is None:
        monkeypatch.delenv("LORASERVE_CPU_GEMM_KERNEL", raising=False)
    else:
        monkeypatch.setenv("LORASERVE_CPU_GEMM_KERNEL", setting)
    monkeypatch.setattr(gemm_cpu, "cpu_flags", lambda: frozenset(flags))
    amx_default = setting != "1" and "amx_bf16" in flags  # unset (or "0", which means oneDNN anyway)
    assert gemm_cpu.prefers_onednn(torch.bfloat16) == amx_default
    assert not gemm_cpu.prefers_onednn(torch.float32)  # AMX has no float32 tiles: the kernel keeps those
    layer = Linear(64, 96, dtype=torch.bfloat16)
    layer.weight.data.normal_()
    dense = layer.weight.detach().clone()
    pack_cpu_linears(nn.ModuleList([layer]))
    if amx_default:
        assert layer.kernel_weight is None  # oneDNN's packed linear (or F.linear) serves it
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    torch.testing.assert_close(layer.base_forward(x), F.linear(x, dense), atol=0.05, rtol=0.02)
