"""LLaVA (1.5) and LLaVA-NeXT: a CLIP/SigLIP vision tower, an MLP projector, and a Llama-family
language model (Llama, Mistral or Qwen2 text configs: `LlamaModel`, natively).

LLaVA's image is one run of `<image>` tokens (the tower's patches, its CLS dropped by the "default"
feature strategy); LLaVA-NeXT's is the base crop and the grid patches, unpadded to the image's aspect,
with a learned `image_newline` after each row: transformers' `get_image_features` computes it, per
image, from the image's own size."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from loraserve.models.llama import LlamaArgs, LlamaModel
from loraserve.models.vlm import VisionLanguageModel, cat_field

# Language models served natively inside a vision-language model, by text config model_type:
# whether q/k/v carry a bias (None: as the config says).
_LLAMA_FAMILY: dict[str, bool | None] = {"llama": None, "mistral": None, "qwen2": True}


def llama_language_model(
    text_config: Any, dtype: torch.dtype, rotary: Any = None, qkv_bias: bool | None = None
) -> tuple[nn.Module, LlamaArgs]:
    """A Llama-family text config's decoder (Llama, Mistral, Qwen2), natively."""
    model_type = getattr(text_config, "model_type", "llama")
    if qkv_bias is None:
        if model_type not in _LLAMA_FAMILY:
            raise ValueError(
                f"the language model of this vision-language checkpoint is a {model_type!r} model; "
                f"natively served ones are {sorted(_LLAMA_FAMILY)}."
            )
        qkv_bias = _LLAMA_FAMILY[model_type]
    args = LlamaArgs.from_config(text_config, qkv_bias=qkv_bias)
    return LlamaModel(args, text_config, dtype, rotary), args


class LlavaForConditionalGeneration(VisionLanguageModel):
    hf_vision_class = "LlavaModel"
    hf_class = "LlavaForConditionalGeneration"

    def _language_model(self, text_config: Any, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        return llama_language_model(text_config, dtype)

    def _encode(self, items: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        config = self.hf_config
        out = self.vision.get_image_features(
            pixel_values=cat_field(items, "pixel_values").to(self._vision_dtype()),
            vision_feature_layer=config.vision_feature_layer,
            vision_feature_select_strategy=config.vision_feature_select_strategy,
            return_dict=True,
        )
        return list(out.pooler_output)


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    hf_vision_class = "LlavaNextModel"
    hf_class = "LlavaNextForConditionalGeneration"

    def _encode(self, items: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        config = self.hf_config
        embeddings = []
        for item in items:  # each image its own grid of crops: one call each
            out = self.vision.get_image_features(
                pixel_values=item["pixel_values"].to(self._vision_dtype()),
                image_sizes=item["image_sizes"],
                vision_feature_layer=config.vision_feature_layer,
                vision_feature_select_strategy=config.vision_feature_select_strategy,
                return_dict=True,
            )
            features = out.pooler_output
            embeddings.append(features if isinstance(features, torch.Tensor) else torch.cat(list(features)))
        return embeddings
