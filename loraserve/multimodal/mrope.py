"""M-RoPE positions of a prompt with images (Qwen2-VL, Qwen2.5-VL), as transformers'
`get_rope_index` computes them for images: text tokens count up by one, the same on all three axes;
an image's tokens (one run of placeholders) take the temporal, height and width indices of their
merged patch in its grid, each offset by the position the image starts at, and the text after it
resumes at that start plus the larger of the grid's merged height and width. A generated token's
three positions are its index plus `delta` (the prompt's largest position + 1 - its length)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from loraserve.multimodal.inputs import ImageItem


def mrope_positions(length: int, images: Sequence[ImageItem], hf_config: Any) -> tuple[torch.Tensor, int]:
    """([3, length] int64 positions, delta) of a prompt whose images are `images` (each one run,
    its `data["image_grid_thw"]` its grid)."""
    merge = int(hf_config.vision_config.spatial_merge_size)
    pieces: list[torch.Tensor] = []
    current = cursor = 0
    for image in sorted(images, key=lambda item: item.first):
        if len(image.runs) != 1:
            raise ValueError("an M-RoPE image's placeholders must be one run")
        start, end = image.runs[0]
        if start > cursor:
            pieces.append(torch.arange(start - cursor).expand(3, -1) + current)
            current += start - cursor
        t, h, w = (int(v) for v in image.data["image_grid_thw"][0])
        h, w = h // merge, w // merge
        if t * h * w != end - start:
            raise ValueError(f"an image of grid {t}x{h}x{w} has {end - start} placeholder tokens")
        grid_t, grid_h, grid_w = torch.meshgrid(
            torch.arange(t), torch.arange(h), torch.arange(w), indexing="ij"
        )
        pieces.append(torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + current)
        current += max(h, w)
        cursor = end
    if length > cursor:
        pieces.append(torch.arange(length - cursor).expand(3, -1) + current)
    positions = torch.cat(pieces, dim=1).to(torch.long)
    return positions, int(positions.max()) + 1 - length
