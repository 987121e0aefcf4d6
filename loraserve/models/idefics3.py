"""Idefics3 and SmolVLM (SmolVLM-256M/500M/2B are Idefics3 checkpoints; SmolVLM2 has its own class):
a SigLIP-style vision tower run on the image's tiles (the global image and the split tiles, each its
own run of `<image>` tokens between row/column markers), a pixel-shuffle connector, and a Llama
language model, natively, at `model.text_model`.

Each image is its own sample of transformers' `get_image_features` (its tiles padded to the batch's
largest, the padding masked and dropped as transformers pads a batch), so its embeddings come out on
their own."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from loraserve.models.llava import llama_language_model
from loraserve.models.vlm import VisionLanguageModel


def _padded(tensors: list[torch.Tensor]) -> torch.Tensor:
    """[1, tiles, ..., H, W] tensors stacked into [N, max tiles, ..., max H, max W], zero-padded."""
    shape = [max(t.shape[d] for t in tensors) for d in range(1, tensors[0].dim())]
    out = []
    for t in tensors:
        pad: list[int] = []
        for d in range(t.dim() - 1, 0, -1):
            pad += [0, shape[d - 1] - t.shape[d]]
        out.append(F.pad(t, pad))
    return torch.cat(out)


class Idefics3ForConditionalGeneration(VisionLanguageModel):
    hf_vision_class = "Idefics3Model"
    hf_class = "Idefics3ForConditionalGeneration"
    language_attr = "text_model"

    def _language_model(self, text_config: Any, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        return llama_language_model(text_config, dtype)

    def _encode(self, items: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixels = _padded([item["pixel_values"] for item in items]).to(self._vision_dtype())
        masks = _padded([item["pixel_attention_mask"] for item in items])
        out = self.vision.get_image_features(
            pixel_values=pixels, pixel_attention_mask=masks, return_dict=True
        )
        return list(out.pooler_output)


class SmolVLMForConditionalGeneration(Idefics3ForConditionalGeneration):
    hf_vision_class = "SmolVLMModel"
    hf_class = "SmolVLMForConditionalGeneration"
