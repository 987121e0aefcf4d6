"""RMSNorm computed in float32 like the reference implementations, then cast back; optionally fused
with the residual add that precedes it in a pre-norm decoder layer. `OffsetRMSNorm` is Gemma's
variant: the checkpoint stores w and the scale is (1 + w), applied in float32 before the cast."""

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


class OffsetRMSNorm(nn.Module):
    """Gemma's RMSNorm: (h * rsqrt(mean(h^2) + eps) * (1 + w)).to(dtype), h the row in float32.
    One rounding at the end (Llama's RMSNorm rounds the normalized row, then multiplies by w), so it
    runs as torch ops: the fused kernel's contract is Llama's."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> the normalized rows, same shape and dtype."""
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).to(x.dtype)
