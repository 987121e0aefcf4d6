"""Speculative decoding's counters, per adapter: what vLLM's `spec_decode_*` metrics export.

Per adapter label (`engine_stats.adapter_label`: "" is the base model): drafts (a sequence's proposals
verified in one step), proposed tokens, accepted tokens and accepted tokens by position (the i-th
proposal of a draft). Written on the engine thread; `snapshot` is safe on any thread.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True)
class SpecCounters:
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


class SpecStats:
    def __init__(self, num_speculative_tokens: int) -> None:
        self.positions = num_speculative_tokens
        self._lock = threading.Lock()
        self._by_adapter: dict[str, SpecCounters] = {}

    def record(self, label: str, proposed: int, accepted: int) -> None:
        """One draft of `proposed` tokens, of which the first `accepted` were accepted."""
        with self._lock:
            counters = self._by_adapter.get(label)
            if counters is None:
                counters = self._by_adapter[label] = SpecCounters(accepted_per_pos=[0] * self.positions)
            counters.num_drafts += 1
            counters.num_draft_tokens += proposed
            counters.num_accepted_tokens += accepted
            for pos in range(min(accepted, self.positions)):
                counters.accepted_per_pos[pos] += 1

    def snapshot(self) -> dict[str, dict[str, Any]]:
        """adapter label -> {"num_drafts", "num_draft_tokens", "num_accepted_tokens": int,
        "accepted_per_pos": [int per position]} (copies)."""
        with self._lock:
            return {
                label: {
                    "num_drafts": c.num_drafts,
                    "num_draft_tokens": c.num_draft_tokens,
                    "num_accepted_tokens": c.num_accepted_tokens,
                    "accepted_per_pos": list(c.accepted_per_pos),
                }
                for label, c in self._by_adapter.items()
            }
