"""RMSNorm computed in float32 like the reference implementations, then cast back; optionally fused
with the residual add that precedes it in a pre-norm decoder layer. `OffsetRMSNorm` is Gemma's
variant: the checkpoint stores w and the scale is (1 + w), applied in float32 before the cast (kept
as a float32 tensor beside the weight, computed again whenever the weight is replaced or written)."""

from __future__ import annotations

import torch
from torch import nn

from loraserve.layers.fused_cpu import NORM_THEN_ADD, offset_rms_norm, rms_norm


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
    One rounding at the end (Llama's RMSNorm rounds the normalized row, then multiplies by w): the
    fused kernel's `offset_rms_norm`, which reads (1 + w) in float32 from `scale()`."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(hidden_size, dtype=dtype), requires_grad=False)
        self.eps = eps
        self._scale: torch.Tensor | None = None
        self._scale_of: tuple[object, int] = (None, -1)  # (weight, its version) the scale was computed from

    def scale(self) -> torch.Tensor:
        """1 + w in float32, the same tensor object while the weight is neither replaced nor written
        (a new one otherwise: the decoder stack, which binds its address, sees the change)."""
        weight = self.weight
        if self._scale is None or self._scale_of[0] is not weight or self._scale_of[1] != weight._version:
            self._scale = (1.0 + weight.detach().float()).contiguous()
            self._scale_of = (weight, weight._version)
        return self._scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., D] -> the normalized rows, same shape and dtype."""
        rows = x.reshape(-1, x.shape[-1])
        return offset_rms_norm(rows, self.scale(), self.eps).view(x.shape)

    def add_to(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """residual += norm(x), in place (the norm rounded, then the sum); returns residual. [T, D]."""
        return offset_rms_norm(x, self.scale(), self.eps, residual, NORM_THEN_ADD)
