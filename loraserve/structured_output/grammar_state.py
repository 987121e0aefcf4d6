"""One sequence's position in its grammar: a matcher that has accepted the sequence's output so far.

The state belongs to the sequence and follows its tokens, never the step: before each mask it
accepts the output tokens appended since the last one. Preemption keeps a sequence's tokens (its
KV is recomputed, its tokens are not resampled), so a preempted sequence resumes where its grammar
was; output tokens that went away (never, today) rebuild the matcher from the start. Speculative
decoding's proposals are accepted only to fill the masks of the rows after them (`fill_ahead`), and
rolled back at once: the state never holds a token the sequence does not.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

_COMPLETE = "the grammar is complete and its stop token was ignored"

logger = logging.getLogger(__name__)


@dataclass(slots=True, eq=False)
class GrammarState:
    matcher: Any  # xgrammar.GrammarMatcher
    num_accepted: int = 0
    dead_end: str | None = None  # why the grammar allows nothing more; the sequence then stops

    def advance(self, output_ids: list[int]) -> None:
        """Accept the output tokens not yet accepted."""
        if len(output_ids) < self.num_accepted:
            self.matcher.reset()
            self.num_accepted, self.dead_end = 0, None
        while self.dead_end is None and self.num_accepted < len(output_ids):
            token = output_ids[self.num_accepted]
            if self.matcher.is_terminated():
                self.dead_end = _COMPLETE
            elif not self.matcher.accept_token(token):
                self.dead_end = f"token {token} is not allowed by the grammar"
            else:
                self.num_accepted += 1

    def fill(self, bitmask: Any, row: int) -> bool:
        """Write the allowed next tokens into `bitmask[row]`; False when nothing may follow."""
        if self.dead_end is None and self.matcher.is_terminated():
            self.dead_end = _COMPLETE
        if self.dead_end is not None:
            return False
        self.matcher.fill_next_token_bitmask(bitmask, row)
        return True

    def fill_ahead(self, bitmask: Any, first_row: int, proposed: Sequence[int]) -> list[str | None]:
        """After `fill(bitmask, first_row - 1)`: the rows after each proposed token, as if the
        sequence had sampled it; per row, why nothing may follow (a dead end) or None. A row after a
        proposal the grammar forbids is left as allocated (every token): the row before masks that
        proposal out, so the row is never sampled from. The proposals are rolled back before returning."""
        reasons: list[str | None] = []
        accepted = 0
        try:
            for i, token in enumerate(proposed):
                if self.dead_end is not None or self.matcher.is_terminated():
                    reasons.append(self.dead_end or _COMPLETE)  # after a dead end: the sequence stops there
                elif accepted < i or not self.matcher.accept_token(token):
                    reasons.append(None)  # never sampled from (see above)
                else:
                    accepted += 1
                    if self.matcher.is_terminated():
                        reasons.append(_COMPLETE)
                    else:
                        self.matcher.fill_next_token_bitmask(bitmask, first_row + i)
                        reasons.append(None)
        finally:
            if accepted:
                self.matcher.rollback(accepted)
        return reasons
