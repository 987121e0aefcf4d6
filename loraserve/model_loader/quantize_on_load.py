"""`--quantization int8`: a float checkpoint's linear weights quantized as they load to Q8_0 blocks
(per 32 weights an fp16 scale and int8s, `formats.quantize_q8_0`), which the Linears keep and the
quantized kernels run, as they run a GGUF file's Q8_0 tensors.

What is quantized is what the GGUF path keeps quantized: every 2-D weight that lands in a `Linear`
(packed shards each on their own), the LM head included; with tied embeddings the head gets a
quantized copy of the embedding, which itself stays dense (the model gathers rows from it). Biases,
norms, embeddings, transposed (Conv1D) weights and rows not a multiple of 32 stay in the serving dtype.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from loraserve.layers.linear import Linear
from loraserve.layers.quant.formats import QuantTensor, quantize_q8_0, repack_rows

_BLOCK = 32  # Q8_0's weights per block


def _tied_embedding_name(model: Any) -> str | None:
    """The embedding parameter a tied LM head shares (its checkpoint name), or None when untied."""
    if not getattr(model, "tie_word_embeddings", False):
        return None
    head = model.lm_head.weight
    for name, module in model.named_modules():
        if isinstance(module, nn.Embedding) and module.weight is head:
            return f"{name}.weight"
    return None


def _linear_weight(model: Any, modules: dict[str, nn.Module], name: str) -> Linear | None:
    """The Linear whose weight (or one of whose packed shards) checkpoint tensor `name` is."""
    target, _ = model._packed_target(name)
    module_name, _, leaf = target.rpartition(".")
    module = modules.get(module_name)
    if not isinstance(module, Linear) or leaf != "weight":
        return None
    if module_name.endswith(model.transposed_weight_modules):
        return None
    return module


def quantize_linears(
    weights: Iterable[tuple[str, torch.Tensor | QuantTensor]], model: Any
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    """`weights` with each float linear weight of `model` (a NativeCausalLM) as Q8_0 blocks."""
    modules = dict(model.named_modules())
    tied = _tied_embedding_name(model)
    for name, tensor in weights:
        if not isinstance(tensor, torch.Tensor) or not tensor.is_floating_point() or tensor.dim() != 2:
            yield name, tensor
            continue
        if name == tied and tensor.shape[1] % _BLOCK == 0:
            yield name, tensor
            yield "lm_head.weight", repack_rows(quantize_q8_0(tensor))
            continue
        module = _linear_weight(model, modules, name)
        if module is None or module.in_features % _BLOCK or (tied is not None and module is model.lm_head):
            yield name, tensor  # a tied head's own entry is skipped by the model; its copy came above
            continue
        yield name, repack_rows(quantize_q8_0(tensor))
