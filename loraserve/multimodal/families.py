"""What differs between the vision-language architectures on the processing side: how the Hugging
Face processor's batched outputs split into each image's encoder inputs, and how the images' tokens
attend (Gemma-3: both ways within an image) and are positioned (Qwen2-VL: M-RoPE).

Each split takes the processor's features and the number of placeholder tokens of each image (which
the processor's replacement strings give) and returns one dict of tensors per image, shaped as a
batch of one for the model's `encode_images`, with no padding left from other images (so an image's
content hash is the same whatever it was sent with).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

Features = Mapping[str, Any]
Split = Callable[[Features, list[int], Any], list[dict[str, torch.Tensor]]]


@dataclass(frozen=True, slots=True)
class ImageFamily:
    name: str
    split: Split
    bidirectional: bool = False  # an image's tokens attend to each other both ways (Gemma-3)
    mrope: bool = False  # three positions per token (Qwen2-VL's M-RoPE)


def _split_llava(features: Features, counts: list[int], hf_config: Any) -> list[dict[str, torch.Tensor]]:
    pixels = features["pixel_values"]
    return [{"pixel_values": pixels[i : i + 1]} for i in range(len(counts))]


def _split_llava_next(features: Features, counts: list[int], hf_config: Any) -> list[dict[str, torch.Tensor]]:
    from transformers.models.llava_next.modeling_llava_next import image_size_to_num_patches

    pixels, sizes = features["pixel_values"], features["image_sizes"]
    items = []
    for i in range(len(counts)):
        num_patches = image_size_to_num_patches(
            image_size=sizes[i].tolist(),
            grid_pinpoints=hf_config.image_grid_pinpoints,
            patch_size=hf_config.vision_config.image_size,
        )
        items.append({"pixel_values": pixels[i : i + 1, :num_patches], "image_sizes": sizes[i : i + 1]})
    return items


def _by_rows(pixels: torch.Tensor, rows: list[int], dim: int = 0) -> list[torch.Tensor]:
    if sum(rows) != pixels.shape[dim]:
        raise ValueError(f"the processor gave {pixels.shape[dim]} pixel rows for images needing {rows}")
    return list(pixels.split(rows, dim=dim))


def _split_gemma3(features: Features, counts: list[int], hf_config: Any) -> list[dict[str, torch.Tensor]]:
    per_row = int(hf_config.mm_tokens_per_image)  # pan-and-scan crops add rows of their own
    rows = [count // per_row for count in counts]
    return [{"pixel_values": part} for part in _by_rows(features["pixel_values"], rows)]


def _split_idefics3(features: Features, counts: list[int], hf_config: Any) -> list[dict[str, torch.Tensor]]:
    vision = hf_config.vision_config
    per_tile = int((vision.image_size // vision.patch_size) ** 2 / hf_config.scale_factor**2)
    tiles = [count // per_tile for count in counts]  # the global image and each split tile
    pixels = _by_rows(features["pixel_values"], tiles, dim=1)
    masks = _by_rows(features["pixel_attention_mask"], tiles, dim=1)
    return [{"pixel_values": p, "pixel_attention_mask": m} for p, m in zip(pixels, masks, strict=True)]


def _split_qwen2_vl(features: Features, counts: list[int], hf_config: Any) -> list[dict[str, torch.Tensor]]:
    grids = features["image_grid_thw"]
    patches = [int(grids[i].prod()) for i in range(len(counts))]
    parts = _by_rows(features["pixel_values"], patches)
    return [{"pixel_values": part, "image_grid_thw": grids[i : i + 1]} for i, part in enumerate(parts)]


LLAVA = ImageFamily("llava", _split_llava)
LLAVA_NEXT = ImageFamily("llava_next", _split_llava_next)
GEMMA3 = ImageFamily("gemma3", _split_gemma3, bidirectional=True)
IDEFICS3 = ImageFamily("idefics3", _split_idefics3)
QWEN2_VL = ImageFamily("qwen2_vl", _split_qwen2_vl, mrope=True)

FAMILIES: dict[str, ImageFamily] = {
    "LlavaForConditionalGeneration": LLAVA,
    "LlavaNextForConditionalGeneration": LLAVA_NEXT,
    "Gemma3ForConditionalGeneration": GEMMA3,
    "Idefics3ForConditionalGeneration": IDEFICS3,
    "SmolVLMForConditionalGeneration": IDEFICS3,
    "Qwen2VLForConditionalGeneration": QWEN2_VL,
    "Qwen2_5_VLForConditionalGeneration": QWEN2_VL,
}


def image_token_id(hf_config: Any) -> int:
    """The placeholder token the image embeddings replace (`image_token_id`, older `image_token_index`)."""
    for name in ("image_token_id", "image_token_index"):
        value = getattr(hf_config, name, None)
        if isinstance(value, int):
            return value
    raise ValueError(f"{type(hf_config).__name__} names no image token (image_token_id).")
