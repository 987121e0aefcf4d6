"""Gemma-3 natively: the text model (Gemma-2's layers plus per-head q/k norms, two rope bases, the 5:1
sliding/global pattern, all in `gemma.GemmaArgs` under version 3), and the multimodal model.

`Gemma3ForConditionalGeneration` takes images: a SigLIP tower, the projector's average pooling, soft
norm and projection to `mm_tokens_per_image` embeddings per image (transformers' modules), placed over
the image's `<image_soft_token>`s, after the embedding scale as transformers does. An image's tokens
attend to each other both ways in the prefill (`bidirectional_images`: the scheduler keeps each image
in one chunk and the attention adds the image's later tokens to its rows' keys), causally otherwise.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch
from torch import nn

from loraserve.models.gemma import GemmaArgs, GemmaForCausalLM, GemmaModel
from loraserve.models.vlm import VisionLanguageModel, cat_field


class Gemma3ForCausalLM(GemmaForCausalLM):
    version = 3


class Gemma3ForConditionalGeneration(VisionLanguageModel):
    hf_vision_class = "Gemma3Model"
    hf_class = "Gemma3ForConditionalGeneration"
    bidirectional_images = True
    compute_logits = GemmaForCausalLM.compute_logits  # the final softcap, where a config sets one

    def _language_model(self, text_config: Any, dtype: torch.dtype) -> tuple[nn.Module, Any]:
        args = GemmaArgs.from_config(text_config, version=3)
        return GemmaModel(args, text_config, dtype), args

    def _encode(self, items: Sequence[Mapping[str, torch.Tensor]]) -> list[torch.Tensor]:
        pixels = cat_field(items, "pixel_values").to(self._vision_dtype())
        features = self.vision.get_image_features(pixel_values=pixels, return_dict=True).pooler_output
        rows = [int(item["pixel_values"].shape[0]) for item in items]  # pan-and-scan crops: rows of their own
        return [part.reshape(-1, part.shape[-1]) for part in features.split(rows)]
