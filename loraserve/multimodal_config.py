"""`MultiModalConfig`: what a request may bring to a vision-language model and where its images may
come from (vLLM's MultiModalConfig and the media fields of its ModelConfig), and loraserve's own bounds
on one image. Declared with `option` like the other configs (config.py holds the rest)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraserve.option_types import json_object, positive_int
from loraserve.options import check_options, option

_MM = "multimodal (images)"
MODALITIES = ("image", "video", "audio")
DEFAULT_IMAGES_PER_PROMPT = 8


def mm_limits(value: str) -> dict[str, int]:
    """--limit-mm-per-prompt as vLLM spells it: a JSON object ('{"image": 4}'), or its older
    comma-separated form ('image=4,video=0')."""
    import argparse

    text = value.strip()
    if text.startswith("{"):
        parsed: dict[str, Any] = json_object(text)
    else:
        parsed = {}
        for part in filter(None, (p.strip() for p in text.split(","))):
            name, sep, count = part.partition("=")
            if not sep:
                raise argparse.ArgumentTypeError(f"expected JSON such as '{{\"image\": 4}}', got {value!r}")
            parsed[name.strip()] = count.strip()
    out: dict[str, int] = {}
    for name, count in parsed.items():
        try:
            out[name] = int(count)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"{name}: expected an integer count, got {count!r}") from exc
    return out


def _known_modalities(limits: Mapping[str, int]) -> str | None:
    unknown = sorted(set(limits) - set(MODALITIES))
    if unknown:
        return f"names unknown modalities {unknown}; known: {list(MODALITIES)}."
    negative = sorted(name for name, count in limits.items() if not isinstance(count, int) or count < 0)
    return f"must give each modality a count >= 0, got {dict(limits)}." if negative else None


@dataclass(frozen=True)
class MultiModalConfig:
    """What a request may bring to a vision-language model, and where images may come from (vLLM's
    MultiModalConfig and the media fields of its ModelConfig); loraserve's own bounds on one image."""

    limit_mm_per_prompt: Mapping[str, int] = option(
        default_factory=dict,
        type=mm_limits,
        check=_known_modalities,
        group=_MM,
        help="Most items of each modality in one prompt, as JSON, e.g. '{\"image\": 4}' (default: "
        f"{DEFAULT_IMAGES_PER_PROMPT} images; only images are served).",
    )
    allowed_local_media_path: str = option(
        "",
        group=_MM,
        help="A folder whose files requests may name as file:// image URLs (symlinks resolved; nothing "
        "outside it). Default: none, file:// URLs are refused.",
    )
    allowed_media_domains: tuple[str, ...] | None = option(
        None,
        nargs="+",
        group=_MM,
        help="Host names http(s) image URLs may point to, redirects included (default: any).",
    )
    mm_processor_kwargs: Mapping[str, Any] | None = option(
        None,
        type=json_object,
        group=_MM,
        help="JSON keyword arguments for the model's Hugging Face processor, e.g. "
        "'{\"do_pan_and_scan\": true}' (Gemma-3).",
    )
    max_image_pixels: int = option(
        25_000_000,
        type=positive_int,
        group=_MM,
        help="loraserve only: the most pixels (width x height) an image may declare; larger ones, "
        "decompression bombs among them, are refused from their header before any pixel is decoded "
        "(default: 25 million).",
    )
    max_image_bytes: int = option(
        20 << 20,
        type=positive_int,
        group=_MM,
        help="loraserve only: the largest image file a request may send or point to, e.g. 20MiB (default).",
    )
    mm_embedding_cache_bytes: int = option(
        256 << 20,
        flag=("--mm-embedding-cache", "--mm-embedding-cache-bytes"),
        metavar="BYTES",
        type=positive_int,
        group=_MM,
        help="loraserve only: memory for image embeddings kept by content hash, so a repeated image is "
        "not encoded again, e.g. 256MiB (default).",
    )

    def __post_init__(self) -> None:
        check_options(self)

    @property
    def images_per_prompt(self) -> int:
        return int(self.limit_mm_per_prompt.get("image", DEFAULT_IMAGES_PER_PROMPT))
