"""Build the model: resolve its class, construct it on the device in the model dtype, load the weights
(linears quantized on the way in for --quantization int8), and on CPU pack the linear weights for the
C linear kernel (or oneDNN where it does not serve)."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn

from loraserve import envs
from loraserve.config import INT8_QUANTIZATIONS, ModelConfig
from loraserve.layers.linear import Linear, home_quantized, pack_cpu_linears
from loraserve.layers.quant.formats import QuantTensor
from loraserve.layers.rotary import RotaryEmbedding
from loraserve.model_loader.quantize_on_load import quantize_linears
from loraserve.model_loader.weights import iterate_weights
from loraserve.models.registry import resolve_model_cls
from loraserve.native import huge_pages

logger = logging.getLogger(__name__)


@contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    """Scope torch's default dtype so parameters created without an explicit dtype get the model's."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)


def _count_tensors(
    weights: Iterator[tuple[str, torch.Tensor | QuantTensor]], counter: list[int]
) -> Iterator[tuple[str, Any]]:
    for item in weights:
        counter[0] += 1
        yield item


def get_model(model_config: ModelConfig, device: torch.device | str) -> nn.Module:
    """The model of `model_config` on `device`, weights loaded (packed on CPU), in eval mode."""
    device = torch.device(device)
    cls, arch = resolve_model_cls(
        model_config.architectures, model_config.model_impl, hf_config=model_config.hf_config
    )
    start = time.perf_counter()
    with _default_dtype(model_config.dtype), torch.device(device):
        model: Any = cls(model_config.hf_config, model_config.dtype)
    num_tensors = [0]
    if model_config.load_format == "dummy":
        _dummy_weights(model)
    else:
        weights = iterate_weights(
            model_config.model_path, model_config.config_format, model_config.load_format
        )
        if not getattr(model, "loads_quantized", False):  # the transformers backend: dense weights only
            if model_config.quantization in INT8_QUANTIZATIONS:
                raise ValueError(
                    f"quantization {model_config.quantization!r} needs a native model implementation; "
                    f"{arch} runs on the transformers backend, whose layers take dense weights only."
                )
            weights = iter(_dequantized(weights, model_config.dtype))
        elif model_config.quantization in INT8_QUANTIZATIONS:
            weights = quantize_linears(weights, model)
        model.load_weights(_count_tensors(weights, num_tensors))
    model.eval()
    for module in model.modules():  # rope tables as long as max_model_len (VLLM_ALLOW_LONG_MAX_MODEL_LEN)
        if isinstance(module, RotaryEmbedding):
            module.cover(model_config.max_model_len)
    num_params = sum(p.numel() for p in model.parameters())
    logger.info(
        "Loaded %s as %s (%s) on %s in %s: %d checkpoint tensors, %.1fM parameters, %.2fs.",
        model_config.model,
        arch,
        cls.__name__,
        device,
        model_config.dtype,
        num_tensors[0],
        num_params / 1e6,
        time.perf_counter() - start,
    )
    if device.type == "cpu" and envs.cpu_packed_linear():
        _pack_linears(model)
    if device.type == "cpu":
        home_quantized(model)
        huge_pages.trim_heap()  # the load's freed temporaries out of RSS
    return model


def _dequantized(
    weights: Iterator[tuple[str, torch.Tensor | QuantTensor]], dtype: torch.dtype
) -> Iterator[tuple[str, torch.Tensor | QuantTensor]]:
    for name, tensor in weights:
        yield name, tensor.dequantize(dtype) if isinstance(tensor, QuantTensor) else tensor


def _dummy_weights(model: nn.Module) -> None:
    """load_format "dummy" (vLLM's, for profiling without a checkpoint): small random values everywhere."""
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            values = torch.empty(param.shape, dtype=torch.float32).uniform_(-1e-3, 1e-3, generator=generator)
            param.copy_(values.to(param.dtype))
    logger.warning("load_format 'dummy': the model runs on random weights; its outputs are noise.")


def _pack_linears(model: nn.Module) -> None:
    """CPU-kernel-packed weights for every Linear; tensors shared with other layers (tied embeddings)
    keep their dense copy."""
    shared = {
        param.data_ptr()
        for module in model.modules()
        if not isinstance(module, Linear)
        for param in module.parameters(recurse=False)
    }
    num_packed = pack_cpu_linears(model, shared)
    logger.info("Packed %d linear layers for the CPU linear kernels", num_packed)
