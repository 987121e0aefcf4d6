"""`EmbeddingCache`: encoded images kept by content hash, bounded in bytes, least recently used out.

Keys are (content hash, tower key): the tower key is "" when the vision tower runs without adapter
terms, else the adapter's identity (content digest and scale), so an image encoded under one tower
adapter is never served to another or to a reloaded version of it. An entry larger than the whole
budget is not kept. Engine thread only (the model runner's).
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

CacheKey = tuple[str, str]


@dataclass(slots=True)
class CacheCounters:
    hits: int = 0
    misses: int = 0
    encoded: int = 0  # images run through the vision tower


class EmbeddingCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[CacheKey, torch.Tensor] = OrderedDict()
        self.counters = CacheCounters()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, key: CacheKey) -> torch.Tensor | None:
        found = self._entries.get(key)
        if found is None:
            self.counters.misses += 1
            return None
        self._entries.move_to_end(key)
        self.counters.hits += 1
        return found

    def put(self, key: CacheKey, embeddings: torch.Tensor) -> None:
        size = embeddings.numel() * embeddings.element_size()
        if size > self.max_bytes:
            return
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_bytes -= old.numel() * old.element_size()
        while self._entries and self.num_bytes + size > self.max_bytes:
            _, evicted = self._entries.popitem(last=False)
            self.num_bytes -= evicted.numel() * evicted.element_size()
        self._entries[key] = embeddings
        self.num_bytes += size
