"""Gemma-3 (text) natively: Gemma-2's layers plus per-head q/k norms, two rope bases (the local one for
the sliding layers) and the 5:1 sliding/global pattern, all in `gemma.GemmaArgs` under version 3.

`Gemma3ForConditionalGeneration` checkpoints serve their language model only (no image input): the
text config is `hf_config.get_text_config()`, the text model sits at `model.language_model`, as in
transformers 5's checkpoints, so its tensors and PEFT adapters trained on the multimodal model find
their modules by name; older checkpoints' `language_model.model.*` names are mapped onto it, and the
vision tower and projector are skipped.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.models.gemma import GemmaForCausalLM, GemmaModel


class Gemma3ForCausalLM(GemmaForCausalLM):
    version = 3


# Transformers before 5 saved the language model as `language_model.model.*` / `language_model.lm_head`.
_OLD_PREFIXES = (("language_model.model.", "model.language_model."), ("language_model.lm_head.", "lm_head."))
_VISION_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


class _TextOfMultimodal(nn.Module):
    """The multimodal model's `model`: only its `language_model` is built."""

    def __init__(self, language_model: GemmaModel) -> None:
        super().__init__()
        self.language_model = language_model

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[KVCache],
        batch: ForwardBatch,
    ) -> torch.Tensor:
        return self.language_model(input_ids, positions, kv_caches, batch)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text part of a Gemma-3 multimodal checkpoint."""

    def __init__(self, hf_config: Any, dtype: torch.dtype) -> None:
        super().__init__(hf_config, dtype)
        text_model, lm_head = self.model, self.lm_head
        del self.model, self.lm_head  # registered again in the checkpoint's order: model, then the head
        self.model = _TextOfMultimodal(text_model)  # type: ignore[assignment]
        self.lm_head = lm_head  # (a tied head's weight is named after the embedding, as loading expects)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_text_weights(weights))


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for old, new in _OLD_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor
