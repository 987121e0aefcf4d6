"""`ValueCheck.term_ok`: the bound on the products the LoRA kernels form (t = x @ A^T, then
(t @ B^T) * scale), checked against the products themselves for the worst input with |x| <= 1."""

from __future__ import annotations

import math

import pytest
import torch

from loraserve.lora.adapter_checks import ValueCheck

FP32_MAX = torch.finfo(torch.float32).max


def _worst_case(a: torch.Tensor, b: torch.Tensor, scale: float) -> tuple[float, float]:
    """The largest |t| and |output| any input with |x| <= 1 gives: x = sign of the row that wins."""
    a64, delta = a.double(), scale * (b.double() @ a.double())
    return float(a64.abs().sum(dim=1).max()), float(delta.abs().sum(dim=1).max())


def _adapter(seed: int, magnitude: float, rank: int = 4, size: int = 16) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    a = torch.randn(rank, size, generator=gen) * magnitude
    b = torch.randn(size, rank, generator=gen) * magnitude
    return a, b


@pytest.mark.parametrize("magnitude", [1e-2, 1.0, 1e4, 1e8, 1e9, 1e10, 1e18])
def test_accepted_terms_never_exceed_the_ceiling_and_the_fast_path_agrees(magnitude: float) -> None:
    ceiling = math.sqrt(FP32_MAX)
    for seed in range(20):
        a, b = _adapter(seed, magnitude)
        largest = float(torch.cat([a.flatten(), b.flatten()]).abs().max())
        exact = ValueCheck(None, FP32_MAX).term_ok(a, b, 2.0)
        fast = ValueCheck(largest, FP32_MAX).term_ok(a, b, 2.0)
        assert fast == exact  # the bound only skips the pass, it never changes the verdict
        t_max, out_max = _worst_case(a, b, 2.0)
        if exact:
            assert t_max <= ceiling and out_max <= ceiling
        if out_max > ceiling or t_max > ceiling:
            assert not exact


def test_the_issue_s_repros_and_a_normal_adapter() -> None:
    a, b = _adapter(0, 0.02, rank=8, size=64)
    check = ValueCheck(None, float(torch.finfo(torch.bfloat16).max))
    assert check.term_ok(a, b, 16 / 8)
    assert not check.term_ok(a, b, 1e38 / 8)  # lora_alpha 1e38
    big = a.clone()
    big[0, 0] = 3e38  # one weight of 3e38
    assert not check.term_ok(big, b, 2.0)
    assert check.term_ok(a, torch.zeros_like(b), 1e38)  # B = 0 (PEFT's initialisation) adds nothing


def test_empty_tensors_and_unbounded_dtypes_pass() -> None:
    assert ValueCheck(None, FP32_MAX).term_ok(torch.zeros(0, 8), torch.zeros(8, 0), 1e38)
    a, b = _adapter(1, 1e30)
    assert ValueCheck(None, math.inf).term_ok(a, b, 2.0)
