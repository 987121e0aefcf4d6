"""Linear layers, plain and packed (qkv, gate_up), with declarative shard loading.

A packed layer holds the weights of several checkpoint tensors stacked along the output dimension;
`output_sizes` records the slices so the loader can place each shard and the LoRA layer can apply a
different adapter matrix to each slice. Weights are kept as [out, in] and applied with `F.linear`,
which is faster on CPU than `x @ W` with W as [in, out].

On CPU, `pack_cpu_linears` reorders each weight once for the kernel that runs it: our own
(`gemm_cpu`, where it serves the dtype on this CPU: small-M decode products run near the vector
units' peak) or else oneDNN's blocked layout (faster than `F.linear` on a dense weight). The dense
copy is then released (except where the tensor is shared, e.g. tied embeddings).

A layer may instead hold its weight block-quantized (`quant_parts`, one GGUF-format weight per output
slice, loaded with `load_quant_shard`; `layers/quant`): its forward runs the quantized kernel into each
slice and it has no dense copy. A packed layer whose checkpoint mixes quantized and dense shards is
dequantized at `finish_loading`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch
from loraserve.layers import gemm_cpu
from loraserve.layers.quant import kernel as quant_kernel
from loraserve.layers.quant.embedding import QuantEmbedding
from loraserve.layers.quant.formats import QuantTensor
from loraserve.native import huge_pages


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
        self.packed_weight: torch.Tensor | None = None  # oneDNN layout of `weight` (CPU only)
        self.kernel_weight: gemm_cpu.PackedWeight | None = None  # the C kernel's layout (CPU only)
        self.quant_parts: list[quant_kernel.QuantWeight | None] | None = None  # per slice, when quantized

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

    def load_quant_shard(self, tensor: QuantTensor, shard: int | None) -> None:
        """Keep a block-quantized checkpoint weight for the whole layer or one output slice."""
        offsets = self.slice_offsets()
        want = (self.out_features if shard is None else offsets[shard + 1] - offsets[shard], self.in_features)
        if tensor.shape != want:
            raise ValueError(f"shape mismatch for weight (shard {shard}): model {want}, checkpoint {tensor.shape}")
        if self.quant_parts is None:
            self.quant_parts = [None] * len(self.output_sizes)
        if shard is None and len(self.output_sizes) > 1:  # one tensor for every slice: split its rows
            for i in range(len(self.output_sizes)):
                part = QuantTensor(tensor.blocks[offsets[i] : offsets[i + 1]], tensor.qtype, (offsets[i + 1] - offsets[i], self.in_features))
                self.quant_parts[i] = quant_kernel.prepare(part)
        else:
            self.quant_parts[shard or 0] = quant_kernel.prepare(tensor)

    def finish_loading(self) -> None:
        """After the checkpoint: a fully quantized layer drops its dense weight (replaced, not resized:
        a tied LM head shares it with the embedding); a partly quantized one is dequantized into it."""
        parts = self.quant_parts
        if parts is None:
            return
        dtype = self.weight.dtype
        if all(part is not None for part in parts):
            self.weight = nn.Parameter(torch.empty(0, dtype=dtype, device=self.weight.device), requires_grad=False)
            return
        offsets = self.slice_offsets()
        with torch.no_grad():
            for i, part in enumerate(parts):
                if part is not None:
                    self.weight.data[offsets[i] : offsets[i + 1]] = quant_kernel.dequantize_rows(part, torch.float32)
        self.quant_parts = None

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant_parts is not None:
            return self._quant_forward(x, self.quant_parts)
        # A weight packed for the C kernel has no other copy: `linear` raises where it does not serve x.
        if self.kernel_weight is not None:
            return gemm_cpu.linear(x, self.kernel_weight, self.bias)
        if self.packed_weight is not None:
            return _packed_linear(x, self.packed_weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def _quant_forward(self, x: torch.Tensor, parts: list[quant_kernel.QuantWeight | None]) -> torch.Tensor:
        rows = x.reshape(-1, self.in_features)
        if len(parts) == 1 and parts[0] is not None:
            out = quant_kernel.linear(rows, parts[0], self.bias)
        else:
            out = torch.empty(rows.shape[0], self.out_features, dtype=x.dtype)
            offsets = self.slice_offsets()
            for i, part in enumerate(parts):
                assert part is not None  # finish_loading leaves no gaps
                bias = None if self.bias is None else self.bias[offsets[i] : offsets[i + 1]]
                quant_kernel.linear(rows, part, bias, out=out[:, offsets[i] : offsets[i + 1]])
        return out.view(*x.shape[:-1], self.out_features)

    def forward(self, x: torch.Tensor, batch: ForwardBatch | None = None) -> torch.Tensor:
        return self.base_forward(x)

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.output_sizes}, bias={self.bias is not None}"


def packed_rows(num_rows: int) -> int:
    """The row count a packed linear runs with: 16, 32, 64, then the next multiple of 32.

    oneDNN keeps state for every input shape its packed linear has seen, and a server sees nearly every
    token count up to max_num_batched_tokens, so its memory grew for as long as new counts came (about
    30 KB per new count and layer). Rounding up bounds the shapes to a few dozen; the extra rows cost
    little, since a small batch's matmul is bound by reading the weights, not by its rows.
    """
    if num_rows <= 16:
        return 16
    if num_rows <= 64:
        return 1 << (num_rows - 1).bit_length()
    return -(-num_rows // 32) * 32


def _packed_linear(x: torch.Tensor, packed_weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    rows = x.reshape(-1, x.shape[-1])
    num_rows = rows.shape[0]
    padded = packed_rows(num_rows)
    if padded != num_rows:
        rows = F.pad(rows, (0, 0, 0, padded - num_rows))
    out = torch.ops.mkldnn._linear_pointwise(rows, packed_weight, bias, "none", [], "")
    return out[:num_rows].reshape(*x.shape[:-1], out.shape[-1])


def pack_cpu_linears(model: nn.Module, shared: set[int] | None = None) -> int:
    """Reorder every `Linear` weight of a CPU model into the C kernel's layout where it serves the
    dtype and oneDNN is not preferred (bf16 on AMX CPUs: `gemm_cpu.prefers_onednn`), else oneDNN's;
    returns how many were packed.

    Dense weights whose storage nothing else uses are released. Dtypes neither can pack on this CPU
    (bf16 without AVX-512) keep the plain `F.linear` path.
    """
    shared = shared or set()
    num_packed = 0
    kernel_weights: list[gemm_cpu.PackedWeight] = []
    for module in model.modules():
        if not isinstance(module, Linear) or module.weight.device.type != "cpu" or module.weight.numel() == 0:
            continue
        dtype = module.weight.dtype
        module.kernel_weight = None if gemm_cpu.prefers_onednn(dtype) else gemm_cpu.pack(module.weight.detach())
        if module.kernel_weight is not None:
            kernel_weights.append(module.kernel_weight)
        elif not _pack_onednn(module):
            continue
        if module.weight.data_ptr() not in shared:
            module.weight.data = torch.empty(0, dtype=module.weight.dtype)
        num_packed += 1
    # One mapping on huge pages for all of them (a step streams every one), then the prefetch ring.
    homes = huge_pages.zeros([(tuple(w.data.shape), w.data.dtype) for w in kernel_weights], "cpu")
    for weight, home in zip(kernel_weights, homes, strict=True):
        weight.data = home.copy_(weight.data)
    gemm_cpu.chain_prefetch(kernel_weights)  # modules register in the order they run
    return num_packed


def home_quantized(model: nn.Module) -> None:
    """Every quantized weight's blocks moved into one mapping on huge pages, as the packed dense weights
    are: a decode step streams them all, and on 4 KiB pages the prefetchers stop at every page. Blocks
    two modules share (a tied LM head's, which its `QuantEmbedding` gathers from) move once and stay
    shared; each old tensor is let go once copied, so loading needs one tensor's room more, not twice,
    and nothing is left holding the checkpoint file's mapping."""
    users: dict[int, list[quant_kernel.QuantWeight | QuantEmbedding]] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            for part in module.quant_parts or []:
                if part is not None:
                    users.setdefault(part.tensor.blocks.data_ptr(), []).append(part)
    for module in model.modules():  # an untied one too: its blocks are a view of the file's mapping,
        if isinstance(module, QuantEmbedding):  # which would keep every page the load read resident
            users.setdefault(module.blocks.data_ptr(), []).append(module)
    homes = huge_pages.zeros([(tuple(g[0].tensor.blocks.shape), torch.uint8) for g in users.values()], "cpu")
    for group, home in zip(users.values(), homes, strict=True):
        home.copy_(group[0].tensor.blocks)
        for user in group:
            if isinstance(user, QuantEmbedding):
                user.blocks = home
            else:
                user.tensor, user.args = QuantTensor(home, user.tensor.qtype, user.tensor.shape), None


def _pack_onednn(module: Linear) -> bool:
    if not torch.backends.mkldnn.is_available():
        return False
    try:
        module.packed_weight = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach())
    except RuntimeError:  # a dtype oneDNN cannot pack on this CPU
        return False
    return True
