"""DoRA (PEFT's `use_dora`), unmerged: the per-output scale g = m / ||W + s B A|| of one module.

PEFT's DoRA layer computes y = g * (x W^T + s B A x) + b, with m the adapter's magnitude vector and
the norm taken per output row of W + s B A (the weight's dim 1), detached. g is fixed by the adapter
and the base weights, so it is computed once, when the adapter is read, and a slot holds it beside A
and B (`LoRABuffers.dora`): the step then multiplies each DoRA token's row of the layer's output,
less the base bias, by its slot's g (`ops.apply_dora`), after the LoRA term is added.

The base weight is not kept dense on CPU (`layers.linear.pack_cpu_linears` releases it once packed),
so the norm is expanded into what the packed layer can compute:
    ||W_i + s (BA)_i||^2 = ||W_i||^2 + 2 s sum_k B_ik (A W^T)_ki + s^2 B_i (A A^T) B_i^T
where A W^T is the layer's own product of A's rows (less its bias) and ||W_i||^2 comes from its
product of the identity, once per layer (cached, weakly, by layer), in float32.
"""

from __future__ import annotations

import threading
import weakref

import torch

from loraserve.layers.linear import Linear

_IDENTITY_ROWS = 256  # rows of the identity per product: bounds the scratch for wide layers
_row_norms: weakref.WeakKeyDictionary[Linear, torch.Tensor] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def _product(base: Linear, rows: torch.Tensor) -> torch.Tensor:
    """rows @ W^T in float32, through the base layer's own kernels (its bias taken off)."""
    out = base.base_forward(rows.to(_weight_dtype(base))).float()
    return out if base.bias is None else out - base.bias.detach().float()


def _weight_dtype(base: Linear) -> torch.dtype:
    return base.weight.dtype  # kept when the dense weight is released


def weight_row_norms_sq(base: Linear) -> torch.Tensor:
    """||W_i||^2 for every output row i of the base layer, float32 [out] (computed once per layer)."""
    with _lock:
        cached = _row_norms.get(base)
    if cached is not None:
        return cached
    if base.weight.numel():
        norms = base.weight.detach().float().square().sum(dim=1)
    else:
        norms = torch.zeros(base.out_features)
        with torch.inference_mode():
            for start in range(0, base.in_features, _IDENTITY_ROWS):
                end = min(start + _IDENTITY_ROWS, base.in_features)
                eye = torch.zeros(end - start, base.in_features)
                eye[:, start:end] = torch.eye(end - start)
                norms += _product(base, eye).square().sum(dim=0)
    with _lock:
        _row_norms[base] = norms
    return norms


def dora_scale(
    base: Linear,
    out_start: int,
    out_end: int,
    lora_a: torch.Tensor,
    lora_b: torch.Tensor,
    scaling: float,
    magnitude: torch.Tensor,
) -> torch.Tensor:
    """g = magnitude / ||W + scaling * B A|| per output row in [out_start, out_end), float32 [out_end - out_start]."""
    a, b = lora_a.float(), lora_b.float()
    with torch.inference_mode():
        a_w = _product(base, a)[:, out_start:out_end]  # [r, out]: A W^T
    cross = (b * a_w.t()).sum(dim=1)  # sum_k B_ik (A W^T)_ki
    gram = a @ a.t()
    lora_sq = ((b @ gram) * b).sum(dim=1)  # B_i (A A^T) B_i^T = ||(BA)_i||^2
    norms_sq = weight_row_norms_sq(base)[out_start:out_end] + 2 * scaling * cross + scaling**2 * lora_sq
    return magnitude.float() / norms_sq.clamp_min(0).sqrt()
