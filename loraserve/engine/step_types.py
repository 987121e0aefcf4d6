"""The step's types between the scheduler, the model runner and the output processor: what runs
(`ScheduledSeq`, `SchedulerOutput`) and what a sampled token does to its sequence (`SampledToken`);
and the attention entries of a speculating sequence's rows (`verification_rows`)."""

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


def verification_rows(
    end: int,
    num_draft: int,
    block_ids: list[int],
    query_lens: list[int],
    context_lens: list[int],
    block_tables: list[list[int]],
    seq_lens: list[int],
) -> None:
    """The attention metadata of a speculating sequence's rows (its own token at `end` - 1, then the
    proposals): one single-query entry per row over the sequence's blocks, its context ending at that
    row, as a decode step of the same position sees it. The attention kernel shapes its work by each
    entry's query length, so a row computed here is bit for bit the decode step's, which is what
    makes a greedy output with speculation the output without it; every row's K/V is written before
    any row attends, so each still sees the proposals before it. The sequence lengths are the decode
    steps' too (LongRoPE picks its factors by them)."""
    for row in range(num_draft + 1):
        query_lens.append(1)
        context_lens.append(end + row)
        block_tables.append(block_ids)
        seq_lens.append(end + row)
