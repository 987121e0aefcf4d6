"""The transformers backend's attention: `paged_attention_forward`, registered in transformers'
`AttentionInterface` as `loraserve_paged`.

transformers creates no causal mask for it (masks exist only for implementations in
`AttentionMaskInterface`) and every attention module hands it its rotated q/k/v; it writes K/V into
our paged cache and attends with `PagedAttention` using the step's `AttentionMetadata`. The step
context travels as a forward kwarg (`STEP_KWARG`), which HF models pass down to the attention call,
or, where a model drops the kwargs (StableLM's decoder layer), on the `StepHolder` the owning model
sets on each attention module (`HOLDER_ATTR`); `module.layer_idx` selects the layer's cache.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from transformers import AttentionInterface

from loraserve.batch.attention_metadata import AttentionMetadata
from loraserve.batch.kv_cache import KVCache
from loraserve.layers.attention import PagedAttention

ATTN_IMPLEMENTATION = "loraserve_paged"
STEP_KWARG = "loraserve_step"
HOLDER_ATTR = "_loraserve_step_holder"
# Attention features that change the math and that PagedAttention does not implement (it does
# implement logit softcapping, `softcap`, which Gemma-2 passes).
_UNSUPPORTED_KWARGS = ("s_aux", "sinks")


@dataclass(slots=True)
class StepContext:
    """What the attention function needs for one forward: caches, step indices, per-layer kernels."""

    kv_caches: list[KVCache]
    attn: AttentionMetadata
    kernels: dict[int, PagedAttention]
    sliding_window: int | None
    num_calls: int = 0
    num_sliding_calls: int = 0
    checked_mask: bool = field(default=False)


def _check_mask_is_plain(attention_mask: torch.Tensor | None) -> None:
    """A mask built by the model itself is ignored (ours is equivalent) unless it carries a bias (ALiBi)."""
    if attention_mask is None or not attention_mask.is_floating_point():
        return
    finite = torch.isfinite(attention_mask) & (attention_mask > torch.finfo(attention_mask.dtype).min)
    if bool((attention_mask[finite] != 0).any()):
        raise ValueError(
            "this model adds a positional bias through its attention mask (e.g. ALiBi), which loraserve's "
            "paged attention does not support; use a natively supported architecture."
        )


@dataclass(slots=True)
class StepHolder:
    """The model's current step context, for attention modules whose callers drop the forward kwargs
    (StableLM's decoder layer): each module with a `layer_idx` holds the owning model's holder."""

    step: StepContext | None = None


def _check_call(
    module: nn.Module, attention_mask: torch.Tensor | None, kwargs: dict[str, Any]
) -> tuple[StepContext, int | None]:
    """The step context and the layer's sliding window (None = full); refuses what PagedAttention lacks."""
    step = kwargs.get(STEP_KWARG)
    if step is None and isinstance(holder := getattr(module, HOLDER_ATTR, None), StepHolder):
        step = holder.step
    if not isinstance(step, StepContext):
        raise ValueError(
            f"attn_implementation={ATTN_IMPLEMENTATION!r} only works inside TransformersForCausalLM.forward."
        )
    for name in _UNSUPPORTED_KWARGS:
        if kwargs.get(name) is not None:
            raise ValueError(
                f"this model's attention uses {name!r}, which loraserve's paged attention lacks."
            )
    # HF passes `sliding_window` only to windowed layers (Mistral: to every layer, None without a window).
    window = kwargs.get("sliding_window")
    if window is not None and (window != step.sliding_window or step.attn.sliding_window != window):
        raise ValueError(
            f"layer sliding_window={window} but the step's attention metadata was built for "
            f"sliding_window={step.attn.sliding_window} (model spec: {step.sliding_window})."
        )
    if not step.checked_mask:
        _check_mask_is_plain(attention_mask)
        step.checked_mask = True
    return step, window


def _kernel(
    step: StepContext,
    layer_idx: int,
    shape: tuple[int, int, int],
    scale: float,
    is_sliding: bool,
    softcap: float | None,
) -> PagedAttention:
    """The layer's PagedAttention (num_heads, num_kv_heads, head_dim), built once and reused across steps."""
    num_heads, num_kv_heads, head_dim = shape
    kernel = step.kernels.get(layer_idx)
    wanted = (num_heads, num_kv_heads, head_dim, scale, is_sliding, softcap)
    if (
        kernel is None
        or (
            kernel.num_heads,
            kernel.num_kv_heads,
            kernel.head_dim,
            kernel.scale,
            kernel.use_sliding_window,
            kernel.softcap,
        )
        != wanted
    ):
        kernel = PagedAttention(
            num_heads, num_kv_heads, head_dim, scale, use_sliding_window=is_sliding, softcap=softcap
        )
        step.kernels[layer_idx] = kernel
    return kernel


def paged_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """HF attention signature: query [1, H, T, D], key/value [1, KVH, T, D] -> ([1, T, H, D], None)."""
    step, window = _check_call(module, attention_mask, kwargs)
    layer_idx = getattr(module, "layer_idx", None)
    if not isinstance(layer_idx, int):
        raise ValueError(f"{type(module).__name__} has no integer layer_idx to select its KV cache.")
    _, num_heads, num_tokens, head_dim = query.shape
    num_kv_heads = key.shape[1]
    kv_cache = step.kv_caches[layer_idx]
    k_cache = kv_cache.k
    if tuple(k_cache.shape[1:]) != (num_kv_heads, head_dim) or value.shape[-1] != head_dim:
        raise ValueError(
            f"layer {layer_idx}: attention has {num_kv_heads} kv heads of dims k={head_dim} v={value.shape[-1]} "
            f"but its KV cache is shaped {tuple(k_cache.shape[1:])}."
        )
    scale = scaling if scaling is not None else head_dim**-0.5
    softcap = kwargs.get("softcap")
    kernel = _kernel(
        step, layer_idx, (num_heads, num_kv_heads, head_dim), scale, window is not None, softcap or None
    )
    q = query[0].transpose(0, 1).reshape(num_tokens, num_heads * head_dim)
    k = key[0].transpose(0, 1).reshape(num_tokens, num_kv_heads * head_dim)
    v = value[0].transpose(0, 1).reshape(num_tokens, num_kv_heads * head_dim)
    out = kernel(q, k, v, kv_cache, step.attn)
    step.num_calls += 1
    step.num_sliding_calls += int(window is not None)
    return out.view(1, num_tokens, num_heads, head_dim), None


AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
