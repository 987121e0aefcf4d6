"""How much prompt-logprob work one engine step may do, so that no step runs for long.

A prompt's logprobs cost, per position, a row of logits over the vocabulary (computed in float32,
then log-softmaxed) and top-k entries turned into Python objects. `prompt_logprobs: 20` on an
8,000-token prompt ran as four 2,048-row steps of several seconds each, and a short request waited
behind them all. A step now computes at most `LOGITS_ELEMENTS_PER_STEP` prompt-logprob logits
(~680 rows at a 49k vocabulary, 128 MiB) and `ENTRIES_PER_STEP` top-k entries (1 row at k = vocab):
a prompt asking for them is prefilled in chunks that small, and the rest of the step's token budget
goes to others, who are scheduled in the next step. The first chunk of a step always gets one row,
so every prompt progresses.
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.engine.sequence import Sequence

LOGITS_ELEMENTS_PER_STEP = 1 << 25
ENTRIES_PER_STEP = 1 << 16


@dataclass(slots=True)
class LogprobBudget:
    """One step's prompt-logprob budget; `take` caps a sequence's chunk by what is left."""

    vocab_size: int | None
    logits_left: int = LOGITS_ELEMENTS_PER_STEP
    entries_left: int = ENTRIES_PER_STEP
    rows_taken: int = 0

    def take(self, seq: Sequence, num_new: int) -> int:
        """`num_new` tokens of `seq` to compute this step, fewer if they would compute prompt logprobs
        past the budget (0 once it is spent and some row was given)."""
        k = seq.params.prompt_logprobs
        rows = min(num_new, seq.num_prompt_tokens - 1 - seq.num_computed_tokens)
        if k is None or rows <= 0 or num_new == 0:
            return num_new
        per_row_entries = k + 1
        allowed = self.entries_left // per_row_entries
        if self.vocab_size:
            allowed = min(allowed, self.logits_left // self.vocab_size)
        if allowed <= 0 and self.rows_taken == 0:
            allowed = 1  # the step's first prompt-logprob row always runs: every prompt progresses
        allowed = max(allowed, 0)
        if rows > allowed:
            num_new = allowed  # the chunk stops where its prompt-logprob rows would run out
            rows = allowed
        self.rows_taken += rows
        self.entries_left -= rows * per_row_entries
        if self.vocab_size:
            self.logits_left -= rows * self.vocab_size
        return num_new
