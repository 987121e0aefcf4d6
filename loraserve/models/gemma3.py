"""Gemma-3 (text) natively: Gemma-2's layers plus per-head q/k norms, two rope bases (the local one for
the sliding layers) and the 5:1 sliding/global pattern, all in `gemma.GemmaArgs` under version 3.

`Gemma3ForConditionalGeneration` checkpoints serve their language model only: the text config is
`hf_config.get_text_config()`, the language model's tensors are renamed to the text model's names and the
vision tower and projector are skipped (image inputs are not served).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

import torch

from loraserve.models.gemma import GemmaForCausalLM


class Gemma3ForCausalLM(GemmaForCausalLM):
    version = 3


# Checkpoint prefixes of the multimodal model: transformers 5 saves the first, earlier versions the
# second; both hold the text model's tensors under them.
_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_VISION_PREFIXES = (
    "model.vision_tower.",
    "model.multi_modal_projector.",
    "vision_tower.",
    "multi_modal_projector.",
)


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """The text part of a Gemma-3 multimodal checkpoint."""

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights(_text_weights(weights))


def _text_weights(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    for name, tensor in weights:
        if name.startswith(_VISION_PREFIXES):
            continue
        for old, new in _TEXT_PREFIXES:
            if name.startswith(old):
                name = new + name[len(old) :]
                break
        yield name, tensor
