"""Linear layers, plain and packed (qkv, gate_up), with declarative shard loading.

A packed layer holds the weights of several checkpoint tensors stacked along the output dimension;
`output_sizes` records the slices so the loader can place each shard and the LoRA layer can apply a
different adapter matrix to each slice. Weights are kept as [out, in] and applied with `F.linear`,
which is faster on CPU than `x @ W` with W as [in, out].
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class Linear(nn.Module):
    """y = x W^T + b. `output_sizes` splits the output into slices (one for a plain layer)."""

    def __init__(
        self,
        in_features: int,
        output_sizes: list[int] | int,
        bias: bool = False,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__()
        sizes = [output_sizes] if isinstance(output_sizes, int) else list(output_sizes)
        self.in_features = in_features
        self.output_sizes = sizes
        self.out_features = sum(sizes)
        self.weight = nn.Parameter(torch.empty(self.out_features, in_features, dtype=dtype), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.zeros(self.out_features, dtype=dtype), requires_grad=False) if bias else None
        )

    def slice_offsets(self) -> list[int]:
        offsets = [0]
        for size in self.output_sizes:
            offsets.append(offsets[-1] + size)
        return offsets

    def load_shard(self, name: str, tensor: torch.Tensor, shard: int | None) -> None:
        """Copy a checkpoint tensor ('weight' or 'bias') into the whole layer or one output slice."""
        param = self.weight if name == "weight" else self.bias
        if param is None:
            raise ValueError(f"layer has no {name} but the checkpoint provides one")
        if shard is None:
            target = param.data
        else:
            offsets = self.slice_offsets()
            target = param.data[offsets[shard] : offsets[shard + 1]]
        if target.shape != tensor.shape:
            raise ValueError(f"shape mismatch for {name} (shard {shard}): model {tuple(target.shape)}, "
                             f"checkpoint {tuple(tensor.shape)}")
        target.copy_(tensor)

    def forward(self, x: torch.Tensor, batch: object | None = None) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}"
