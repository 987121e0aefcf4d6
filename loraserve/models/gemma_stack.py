"""`GemmaDecoderStack`: the Gemma family's decoder layers (Gemma, Gemma-2, Gemma-3 text) for one step in
one C call on CPU, the Llama stack's `decoder_stack.c` with its Gemma fields (M_EXT).

What it binds beside Llama's fields: the (1 + w) norm kernel and the float32 scales of every norm
(`OffsetRMSNorm.scale()`), the GeGLU kernel in the activation's place, per-head q/k norm scales,
the attention softcap and each layer's rope tables (Gemma-3's sliding layers have their own base).
The Python loop of `gemma.py` calls the same kernels in the same order, so the two agree bit for
bit; it stays the path for every step or model this does not serve (`build` or `run` return None):
exact-erf GeGLU, per-layer sizes or norms that differ, linears the C kernel does not serve, and
every case `DecoderStack.run` leaves to the loop (LoRA bias terms, other dtypes, switches). The
final-logit softcap stays in `compute_logits`.
"""

from __future__ import annotations

import ctypes
import operator
import struct
from typing import Any

import torch

from loraserve.layers import fused_cpu, gemm_cpu
from loraserve.models.llama_stack import (
    _DTYPE_CODES,
    MODEL_FIELDS,
    BoundObjects,
    DecoderStack,
    _kernel_addresses,
    _layer_fields,
    _libraries,
    _library,
    _linears,
)
from loraserve.native.build import function_address

# decoder_stack.c's Gemma field counts (X_FIELDS, XL_FIELDS).
EXT_FIELDS, EXT_LAYER_FIELDS = 5, 7
_NORMS = (
    "input_layernorm",
    "post_attention_layernorm",
    "pre_feedforward_layernorm",
    "post_feedforward_layernorm",
)


def _norms(layer: Any) -> list[Any]:
    """The layer's (1 + w) norms, its q/k norms included (None where it has none)."""
    attn = layer.self_attn
    return [getattr(layer, name) for name in _NORMS] + [attn.q_norm, attn.k_norm]


def refresh_scales(layers: Any) -> None:
    """Every norm's `scale()`, computed again where a weight was written since: a new scale tensor,
    which `GemmaBoundObjects.unchanged` then reports."""
    for layer in layers:
        for norm in _norms(layer):
            if norm is not None:
                norm.scale()


class GemmaBoundObjects(BoundObjects):
    """`BoundObjects` of a Gemma stack: per layer its rope, modules, linears and every norm's weight
    and float32 scale (call `refresh_scales` first)."""

    def __init__(self, layer_list: Any) -> None:
        self.libraries = _libraries()
        entries: list[tuple[dict[str, Any], str, object]] = []
        for key, layer in layer_list._modules.items():
            attn, mlp = layer._modules["self_attn"], layer._modules["mlp"]
            rotary = attn._modules["rotary"]
            entries += [
                (layer_list._modules, key, layer),
                (layer._modules, "self_attn", attn),
                (layer._modules, "mlp", mlp),
                (attn._modules, "rotary", rotary),
                (rotary._buffers, "cos_table", rotary._buffers.get("cos_table")),
                (rotary._buffers, "sin_table", rotary._buffers.get("sin_table")),
            ]
            for modules, name in (
                (attn._modules, "qkv_proj"),
                (attn._modules, "o_proj"),
                (mlp._modules, "gate_up_proj"),
                (mlp._modules, "down_proj"),
            ):
                linear = modules[name]
                entries += [
                    (modules, name, linear),
                    (linear.__dict__, "kernel_weight", linear.kernel_weight),
                    (linear._parameters, "bias", linear._parameters.get("bias")),
                ]
            for modules, name in [(layer._modules, n) for n in _NORMS] + [
                (attn._modules, "q_norm"),
                (attn._modules, "k_norm"),
            ]:
                norm = modules.get(name)
                entries.append((modules, name, norm))
                if norm is not None:
                    entries += [
                        (norm._parameters, "weight", norm._parameters["weight"]),
                        (norm.__dict__, "_scale", norm.__dict__.get("_scale")),
                    ]
        self._dicts = [d for d, _, _ in entries]
        self._keys = [key for _, key, _ in entries]
        self._objects = [obj for _, _, obj in entries]

    def unchanged(self) -> bool:
        return all(map(operator.is_, _libraries(), self.libraries)) and all(
            map(operator.is_, map(dict.get, self._dicts, self._keys), self._objects)
        )


class GemmaDecoderStack(DecoderStack):
    """`DecoderStack` with decoder_stack.c's Gemma fields; `build` returns None where it cannot serve."""

    ext: ctypes.Array[ctypes.c_int64]
    ext_layers: ctypes.Array[ctypes.c_int64]
    sandwich: bool

    @classmethod
    def build_gemma(cls, layers: list[Any]) -> GemmaDecoderStack | None:
        """For `layers` (GemmaDecoderLayer, their norms' scales fresh); None when some op is not a C
        kernel here or the layers differ in a way the stack's one set of sizes cannot hold."""
        lib = _library() if layers and fused_cpu.kernel_available() else None
        fused = fused_cpu.kernel_library()
        if (
            lib is None
            or fused is None
            or lib.decoder_stack_gemma_layout() != EXT_FIELDS | EXT_LAYER_FIELDS << 8
        ):
            return None
        first = layers[0]
        dtype = first.self_attn.qkv_proj.weight.dtype
        if dtype not in _DTYPE_CODES or not all(_layer_serves(layer, first, dtype) for layer in layers):
            return None
        kernels = _kernel_addresses()
        if kernels is None:
            return None
        kernels[2] = function_address(fused.gelu_tanh_and_mul)  # GeGLU in SiLU-and-mul's place
        attn0, mlp0 = first.self_attn, first.mlp
        sizes = [
            len(layers),
            attn0.qkv_proj.in_features,
            attn0.split_sizes[0],
            attn0.split_sizes[1],
            mlp0.size,
            attn0.num_heads,
            attn0.num_kv_heads,
            attn0.head_dim,
            _DTYPE_CODES[dtype],
        ]
        rotary0 = attn0.rotary
        tables = [rotary0.cos_table.data_ptr(), rotary0.sin_table.data_ptr(), rotary0.cos_table.shape[0]]
        ext_layers = (ctypes.c_int64 * (EXT_LAYER_FIELDS * len(layers)))(
            *[v for layer in layers for v in _ext_layer_fields(layer)]
        )
        sandwich = first.pre_feedforward_layernorm is not None
        softcap = attn0.attn.softcap or 0.0
        ext = (ctypes.c_int64 * EXT_FIELDS)(
            function_address(fused.offset_rms_norm),
            int(sandwich),
            int(attn0.q_norm is not None),
            struct.unpack("<i", struct.pack("<f", softcap))[0],
            ctypes.addressof(ext_layers),
        )
        model_args = (ctypes.c_int64 * MODEL_FIELDS)(*kernels, *sizes, *tables, ctypes.addressof(ext))
        stack = cls(layers, model_args, kernels[5] != 0, first.input_layernorm.eps, attn0.attn.scale, dtype)
        stack.ext, stack.ext_layers, stack.sandwich = ext, ext_layers, sandwich
        return stack

    def _fields(
        self, layer: Any, gemm: list[tuple[int, Any]], k_cache: torch.Tensor, v_cache: torch.Tensor
    ) -> list[int]:
        """Llama's fields with the float32 scales in the norm weights' places."""
        fields = _layer_fields(layer, gemm, k_cache, v_cache)
        fields[0] = layer.input_layernorm.scale().data_ptr()
        fields[1] = layer.post_attention_layernorm.scale().data_ptr()
        return fields


def _ext_layer_fields(layer: Any) -> list[int]:
    attn = layer.self_attn
    pre, post = layer.pre_feedforward_layernorm, layer.post_feedforward_layernorm
    rotary = attn.rotary
    return [
        0 if pre is None else pre.scale().data_ptr(),
        0 if post is None else post.scale().data_ptr(),
        0 if attn.q_norm is None else attn.q_norm.scale().data_ptr(),
        0 if attn.k_norm is None else attn.k_norm.scale().data_ptr(),
        rotary.cos_table.data_ptr(),
        rotary.sin_table.data_ptr(),
        rotary.cos_table.shape[0],
    ]


def _layer_serves(layer: Any, first: Any, dtype: torch.dtype) -> bool:
    """The layer's ops are the stack's, with `first`'s sizes, eps, scale, softcap and norm layout."""
    attn, mlp, ref = layer.self_attn, layer.mlp, first.self_attn
    hidden = attn.qkv_proj.in_features
    norms, ref_norms = _norms(layer), _norms(first)
    widths = [hidden] * 4 + [attn.head_dim] * 2
    return (
        mlp.tanh_gelu
        and mlp.size == first.mlp.size
        and attn.attn.scale == ref.attn.scale
        and attn.attn.softcap == ref.attn.softcap
        and (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        == (ref.num_heads, ref.num_kv_heads, ref.head_dim)
        and attn.split_sizes == [attn.num_heads * attn.head_dim] + [attn.num_kv_heads * attn.head_dim] * 2
        and attn.rotary.head_dim == attn.head_dim
        and fused_cpu.rotary_tables_serve(attn.rotary.cos_table, attn.rotary.sin_table, attn.head_dim)
        and all(_gemm_serves(lin, dtype) for lin in _linears(layer))
        and all((n is None) == (r is None) for n, r in zip(norms, ref_norms))
        and all(
            n is None
            or (fused_cpu.offset_scale_serves(n.scale(), width) and n.eps == first.input_layernorm.eps)
            for n, width in zip(norms, widths)
        )
    )


def _gemm_serves(linear: Any, dtype: torch.dtype) -> bool:
    return gemm_cpu.serves(linear.kernel_weight, dtype) and (
        linear.bias is None or (linear.bias.dtype == dtype and linear.bias.is_contiguous())
    )
