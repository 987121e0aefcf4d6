"""The step's types between the scheduler, the model runner and the output processor: what runs
(`ScheduledSeq`, `SchedulerOutput`) and what a sampled token does to its sequence (`SampledToken`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from loraserve.engine.sequence import DraftRound, Sequence
from loraserve.outputs import PositionLogprobs


@dataclass(slots=True)
class ScheduledSeq:
    seq: Sequence
    num_new_tokens: int  # of the sequence's own tokens
    # Speculative decoding: the tokens proposed after them, run in the same step (None: none).
    draft: DraftRound | None = None

    @property
    def draft_tokens(self) -> list[int]:
        return self.draft.tokens if self.draft is not None else []

    @property
    def num_query_tokens(self) -> int:
        """Positions this step computes for the sequence: its new tokens and the proposed ones."""
        return self.num_new_tokens + (len(self.draft.tokens) if self.draft is not None else 0)


@dataclass(frozen=True, slots=True)
class SampledToken:
    """One sampled token and what it does to its sequence, as the output processor decided."""

    seq: Sequence
    token_id: int
    logprob: float | None  # None unless the request asked for logprobs
    top_logprobs: PositionLogprobs | None  # None unless the request asked for logprobs
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[Sequence] = field(default_factory=list)
    # (source, destination) KV blocks the runner copies before the forward: a beam about to write
    # into a partial block it shares with a sibling gets its own copy first (copy on write).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled
