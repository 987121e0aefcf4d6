"""RMSNorm computed in float32 like the reference implementations, then cast back; optionally fused
with the residual add that precedes it in a pre-norm decoder layer."""

from __future__ import annotations

import torch
from torch import nn

from loraserve.layers.fused_cpu import rms_norm


class RMSNorm(nn.Module):
    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> the normalized rows, same shape."""
        rows = x.reshape(-1, x.shape[-1])
        return rms_norm(rows, self.weight, self.eps)[0].view(x.shape)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """residual += x (in place), then (norm(residual), residual). x, residual [T, D]."""
        out, updated = rms_norm(x, self.weight, self.eps, residual)
        assert updated is not None
        return out, updated
