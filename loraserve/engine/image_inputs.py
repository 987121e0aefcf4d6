"""`ImageInputs`: what a step's image tokens need from the model runner: the image embeddings over
their placeholder rows (`EmbedOverlay`), the spans of image tokens that attend both ways (Gemma-3),
and M-RoPE's three positions per token (Qwen2-VL).

An image's embeddings come from the `EmbeddingCache` (by content hash and tower key) or are encoded
in this step: every missing image of the step in one `encode_images` call per tower adapter (one call
for all when the tower runs without adapter terms). The tower key is "" unless the request's adapter
carries tower or connector weights (--enable-tower-connector-lora): then its identity (the prefix
cache's salt: content digest, scale), so a reloaded adapter never meets its old embeddings; while that
digest is still being computed the embeddings are used but not kept. A prefill chunk that covers part
of an image takes the rows it covers (the rest come from the cache in the next chunk). Engine thread.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from loraserve.batch.attention_metadata import BidirectionalSpan
from loraserve.batch.forward_batch import EmbedOverlay, UniformSlot
from loraserve.engine.block_manager import salt_key
from loraserve.engine.scheduler import ScheduledSeq
from loraserve.engine.sequence import Sequence
from loraserve.multimodal.embedding_cache import EmbeddingCache
from loraserve.multimodal.inputs import ImageItem

if TYPE_CHECKING:
    from loraserve.lora.manager import LoRAManager


@dataclass(slots=True)
class StepImages:
    """The image parts of one step's forward: `None`/empty when the step has no image token."""

    overlay: EmbedOverlay | None = None
    bidirectional: tuple[BidirectionalSpan, ...] = ()
    image_rows: list[int] = field(default_factory=list)  # flat rows whose input id is a placeholder


def step_inputs(
    model: Any, cache_bytes: int, lora: LoRAManager | None, max_loras: int | None, device: torch.device
) -> ImageInputs | None:
    """The model runner's image inputs for a vision-language model; None for a text-only one."""
    return (
        ImageInputs(model, cache_bytes, lora, max_loras, device)
        if getattr(model, "takes_images", False)
        else None
    )


class ImageInputs:
    def __init__(
        self,
        model: Any,
        cache_bytes: int,
        lora: LoRAManager | None,
        max_loras: int | None,
        device: torch.device,
    ) -> None:
        self.model = model
        self.cache = EmbeddingCache(cache_bytes)
        self.lora = lora
        self.max_loras = max_loras
        self.device = device
        self.tower_prefixes: tuple[str, ...] = tuple(getattr(model, "tower_module_prefixes", ()))
        self.mrope = bool(getattr(model, "uses_mrope", False))

    def apply(
        self,
        scheduled: list[ScheduledSeq],
        lora_slots: dict[int, int] | None,
        input_ids: list[int],
        attn: Any,
    ) -> EmbedOverlay | None:
        """The step's image embeddings (None: no image token in it); the image rows' input ids are
        zeroed (their embeddings replace the token's: any id in the vocabulary) and the attention
        metadata `attn` takes the step's both-ways spans."""
        images = self.step(scheduled, lora_slots)
        for row in images.image_rows:
            input_ids[row] = 0
        attn.bidirectional = images.bidirectional
        return images.overlay

    def positions(self, scheduled: list[ScheduledSeq]) -> torch.Tensor:
        return mrope_positions(scheduled, self.device)

    def step(self, scheduled: list[ScheduledSeq], lora_slots: dict[int, int] | None) -> StepImages:
        """The step's image embeddings and spans; `scheduled` in the order of the step's rows."""
        wanted: list[tuple[int, int, int, ImageItem, Sequence]] = []  # (row offset, start, end, image, seq)
        offset = entry = 0  # the item's first row, and its first entry in the attention metadata
        spans: list[BidirectionalSpan] = []
        for item in scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            mm = seq.request.mm
            if mm is not None and start < len(mm.prompt_token_ids):
                for image in mm.images_in(start, end):
                    wanted.append((offset, start, end, image, seq))
                    if mm.bidirectional:
                        spans += _spans(entry, offset, start, end, image)
            # A speculating sequence's proposals follow its token as rows of their own, each row its
            # own attention entry (step_types.verification_rows).
            offset += item.num_new_tokens + len(item.draft_tokens)
            entry += len(item.draft_tokens) + 1 if item.draft_tokens else 1
        if not wanted:
            return StepImages()
        embeddings = self._embeddings([(image, seq) for *_, image, seq in wanted], lora_slots)
        rows: list[int] = []
        parts: list[torch.Tensor] = []
        for (row_offset, start, end, image, _), values in zip(wanted, embeddings, strict=True):
            pairs = list(image.rows_in(start, end))
            rows += [row_offset + position - start for position, _ in pairs]
            parts.append(values[[row for _, row in pairs]])
        overlay = EmbedOverlay(torch.tensor(rows, dtype=torch.long, device=self.device), torch.cat(parts))
        return StepImages(overlay, tuple(spans), rows)

    def _embeddings(
        self, wanted: list[tuple[ImageItem, Sequence]], lora_slots: dict[int, int] | None
    ) -> list[torch.Tensor]:
        """Each (image, sequence)'s embeddings: cached, else encoded now (grouped by tower adapter)."""
        found: dict[tuple[str, str | None, int], torch.Tensor] = {}
        missing: dict[tuple[int, float], dict[tuple[str, str | None, int], tuple[ImageItem, str | None]]] = {}
        keys = []
        for image, seq in wanted:
            tower = self._tower(seq, lora_slots)  # (slot, scale, key) or None for the base tower
            key_text = "" if tower is None else tower[2]
            key = (image.content_hash, key_text, -1 if tower is None else tower[0])
            keys.append(key)
            if key in found or any(key in group for group in missing.values()):
                continue
            cached = self.cache.get((image.content_hash, key_text)) if key_text is not None else None
            if cached is not None:
                found[key] = cached
            else:
                slot_scale = (-1, 1.0) if tower is None else (tower[0], tower[1])
                missing.setdefault(slot_scale, {})[key] = (image, key_text)
        for (slot, scale), group in missing.items():
            uniform = None if slot < 0 else UniformSlot(slot, scale, self.device, self.max_loras)
            items = list(group.values())
            encoded = self.model.encode_images([image.data for image, _ in items], uniform)
            self.cache.counters.encoded += len(items)
            for key, (image, key_text), values in zip(group, items, encoded, strict=True):
                if values.shape[0] != image.num_tokens:
                    raise ValueError(
                        f"an image encoded to {values.shape[0]} embeddings for {image.num_tokens} placeholder tokens"
                    )
                found[key] = values
                if key_text is not None:
                    self.cache.put((image.content_hash, key_text), values)
        return [found[key] for key in keys]

    def _tower(
        self, seq: Sequence, lora_slots: dict[int, int] | None
    ) -> tuple[int, float, str | None] | None:
        """(slot, scale, cache key text) when `seq`'s adapter has tower or connector terms; the key
        text is None while the adapter's digest is unknown (then nothing is cached)."""
        if lora_slots is None or not seq.lora_id or self.lora is None or not self.tower_prefixes:
            return None
        if not self.lora.has_modules_under(seq.lora_id, self.tower_prefixes):
            return None
        key = salt_key(seq.request.cache_salt)
        return lora_slots[seq.lora_id], seq.lora_scale, None if key is None else f"tower:{key}"

    def stats(self) -> dict[str, int]:
        counters = self.cache.counters
        return {
            "images_encoded": counters.encoded,
            "image_cache_hits": counters.hits,
            "image_cache_misses": counters.misses,
            "image_cache_bytes": self.cache.num_bytes,
        }


def _spans(index: int, offset: int, start: int, end: int, image: ImageItem) -> list[BidirectionalSpan]:
    """The both-ways spans of `image`'s runs that this chunk [start, end) computes rows of."""
    spans = []
    for run_start, run_end in image.runs:
        lo, hi = max(run_start, start), min(run_end, end)
        if lo < hi:
            spans.append(
                BidirectionalSpan(index, offset + lo - start, offset + hi - start, lo, run_start, run_end)
            )
    return spans


def mrope_positions(scheduled: list[ScheduledSeq], device: torch.device) -> torch.Tensor:
    """[3, T] M-RoPE positions of the step's tokens: the prompt's from its images, the rest (text-only
    prompts, generated tokens, speculative proposals) their index plus the request's delta, on all
    three axes."""
    columns = []
    for item in scheduled:
        seq, start = item.seq, item.seq.num_computed_tokens
        end = start + item.num_new_tokens + len(item.draft_tokens)  # proposals: positions after its token
        mm = seq.request.mm
        table = mm.mrope_positions if mm is not None else None
        delta = mm.mrope_delta if mm is not None else 0
        if table is not None and start < table.shape[1]:
            columns.append(table[:, start : min(end, table.shape[1])])
            start = table.shape[1]
        if start < end:
            columns.append(torch.arange(start + delta, end + delta).expand(3, -1))
    return torch.cat(columns, dim=1).to(device)
