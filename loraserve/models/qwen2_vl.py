"""Qwen2-VL and Qwen2.5-VL: a ViT over 14x14 patches of the image at its own resolution (2x2 patches
merged into one token; Qwen2.5-VL's with window attention), and a Qwen2 language model, natively, with
M-RoPE: each token has temporal, height and width positions (`layers/rotary_mrope.py`; the prompt's
are computed with its images, `multimodal/mrope.py`), text tokens the same three times.

The vision tower is transformers' (`Qwen2VLModel.get_image_features`: all the step's images in one
call, each attending within itself by its grid); its output is split per image by grid size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from loraserve.layers.rotary import rope_parameters
from loraserve.layers.rotary_mrope import MRotaryEmbedding
from loraserve.models.llama import LlamaArgs, LlamaModel
from loraserve.models.vlm import VisionLanguageModel, cat_field

_DEFAULT_SECTIONS = (16, 24, 24)  # transformers' default when a config names none


class Qwen2VLForConditionalGeneration(VisionLanguageModel):
    hf_vision_class = "Qwen2VLModel"
    hf_class = "Qwen2VLForConditionalGeneration"
    uses_mrope = True

    def _language_model(self, text_config: Any, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        args = LlamaArgs.from_config(text_config, qkv_bias=True)
        params = rope_parameters(text_config)
        sections = params.get("mrope_section") or _DEFAULT_SECTIONS
        rotary = MRotaryEmbedding(text_config, args.head_dim, args.max_positions, sections)
        return LlamaModel(args, text_config, dtype, rotary), args

    def _encode(self, items: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        out = self.vision.get_image_features(
            pixel_values=cat_field(items, "pixel_values").to(self._vision_dtype()),
            image_grid_thw=cat_field(items, "image_grid_thw"),
            return_dict=True,
        )
        return list(out.pooler_output)


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (transformers' name)
    hf_vision_class = "Qwen2_5_VLModel"
    hf_class = "Qwen2_5_VLForConditionalGeneration"
