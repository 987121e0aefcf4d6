"""What a prompt with images is for the engine: `MultiModalInputs` (the expanded prompt ids and its
images) and `ImageItem` (one image: its encoder inputs, content hash and placeholder positions).

An image's embeddings fill its placeholder positions in order: embedding row i goes to the image's
i-th position. Positions are kept as runs of consecutive positions (`runs`): LLaVA's and Gemma-3's
images are one run, Idefics3's tiles one run each (text tokens between them). The content hash is of
the encoder's inputs (the processed pixels and their shapes), so it names exactly what the vision
tower sees: the prefix cache keys the placeholder tokens by it and the embedding cache stores by it.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False, slots=True)
class ImageItem:
    content_hash: str  # sha256 hex of `data` (keys, dtypes, shapes, bytes)
    data: Mapping[str, torch.Tensor]  # the encoder's inputs for this image alone (batch of one)
    runs: tuple[tuple[int, int], ...]  # [start, end) prompt positions its embedding rows fill, in order
    num_tokens: int = field(init=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "num_tokens", sum(end - start for start, end in self.runs))

    @property
    def first(self) -> int:
        return self.runs[0][0]

    @property
    def end(self) -> int:
        return self.runs[-1][1]

    def rows_in(self, start: int, end: int) -> Iterator[tuple[int, int]]:
        """(prompt position, embedding row) of every position of this image in [start, end)."""
        row = 0
        for run_start, run_end in self.runs:
            lo, hi = max(run_start, start), min(run_end, end)
            for position in range(lo, hi):
                yield position, row + position - run_start
            row += run_end - run_start


@dataclass(frozen=True, eq=False, slots=True)
class MultiModalInputs:
    """A processed prompt with images. `mrope_positions` [3, L] and `mrope_delta` are M-RoPE's
    (Qwen2-VL): the prompt's three positions per token, and what a generated token's position adds to
    its index. `bidirectional`: the images' tokens attend to each other both ways (Gemma-3)."""

    prompt_token_ids: list[int]
    images: tuple[ImageItem, ...]
    mrope_positions: torch.Tensor | None = None
    mrope_delta: int = 0
    bidirectional: bool = False

    def runs(self) -> list[tuple[int, int]]:
        """Every placeholder run of every image, in prompt order."""
        return sorted(run for image in self.images for run in image.runs)

    def images_in(self, start: int, end: int) -> list[ImageItem]:
        """The images with a placeholder position in [start, end)."""
        return [
            image
            for image in self.images
            if any(run_start < end and start < run_end for run_start, run_end in image.runs)
        ]

    def block_key(self, start: int, end: int) -> bytes:
        """What a prefix-cache block over positions [start, end) adds to its tokens: the content hash and
        first position of each image it holds placeholders of (empty for a text-only block)."""
        return b"".join(
            f"{image.content_hash}@{image.first};".encode() for image in self.images_in(start, end)
        )

    def clamp_chunk(self, start: int, end: int) -> int:
        """With `bidirectional` attention a chunk must not end inside a run (its tokens see each other):
        the largest end <= `end` that does not, `start` when there is none."""
        if not self.bidirectional:
            return end
        for run_start, run_end in self.runs():
            if run_start < end < run_end:
                return max(start, run_start)
        return end


def content_hash(data: Mapping[str, torch.Tensor]) -> str:
    """sha256 over the tensors by name: dtype, shape and bytes."""
    h = hashlib.sha256()
    for name in sorted(data):
        tensor = data[name].detach().contiguous().cpu()
        h.update(f"{name}|{tensor.dtype}|{tuple(tensor.shape)}|".encode())
        h.update(tensor.view(torch.uint8).numpy().tobytes() if tensor.numel() else b"")
    return h.hexdigest()
