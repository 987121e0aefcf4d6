"""How many tokens each sequence proposes in a step ("adaptive" `draft_policy`): only what is expected
to raise the step's throughput, so speculation never makes a batch slower by its own estimate.

Two estimates feed it. `StepCosts`: what a step of T token rows costs, measured on this machine as
the engine runs (the median of the latest decode steps of exactly T rows, interpolated between the
T's seen, scaled by a linear prior beyond them, forgotten when not seen for a while): a
CPU's linear kernels cost more per row than a GPU's, and a quantized model changes kernel past some
row count, which this table learns by itself. `Acceptance`: each sequence's chance that its next
proposal is accepted: a moving average over its verified proposals (a proposal after a rejected one
is not counted: it was never tried), weighed by how many it tried against the engine's own average
for proposals of the same kind (the ngram method: the length of the n-gram match that made them; a
five-token match into a text being copied is right far more often than a two-token one in free
chat). So a new request drafts at once where such proposals pay and not where they do not, without
paying to find out. While a sequence is held back its tries fade toward the engine's average, whose
unused kinds drift back to the prior, so nothing is written off for good.

`plan_drafts` ranks every possible proposal row, the most likely first (proposal i of a sequence
with acceptance a adds a^i expected tokens), and takes the prefix of that ranking with the most
expected tokens per second, if that beats no proposals by a margin (`_MARGIN`: the estimates are
noisy, and a plan that only breaks even costs when they are off): with one sequence a step takes many
proposals, with a batch of sixteen only the near-certain ones, and one slow measurement at some T
does not cut the plan short there.
"""

from __future__ import annotations

import heapq
import statistics
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass

PRIOR_ACCEPTANCE = 0.7
_WEIGHT = 0.15  # of one verified proposal in the moving average
_RECOVERY = 1 / 64  # of a held-back sequence's tries faded per step (and a kind's gap to the prior)
_PRIOR_TRIES = 4.0  # the engine's average counts as this many of a sequence's own tries
# The linear prior of a step's cost in one-row steps: the fixed part and each row's (a 135M model on
# 2 AVX2 cores pays about a third of a one-row step per extra row; a GPU nearly nothing).
_FIXED, _PER_ROW = 0.65, 0.35
_SAMPLES = 7  # latest steps kept per row count
_STALE = 400  # steps after which a row count's samples no longer count (the machine's load moves)
_PASS_PRIOR = 0.15  # a draft model's pass, in one-row target steps, until measured
_NEGLIGIBLE = 0.02  # expected tokens below which a proposal is never worth a row
_MARGIN = 1.1  # a plan's expected tokens per second over no proposals' at least
_MAX_ROWS = 4096  # row counts above this are not tabled (they are prefills, never decode steps)


@dataclass(slots=True)
class Acceptance:
    rate: float = PRIOR_ACCEPTANCE
    tried: float = 0.0  # proposals verified (fading while held back)

    def observe(self, proposed: int, accepted: int) -> None:
        for _ in range(accepted):
            self.rate += _WEIGHT * (1.0 - self.rate)
        if accepted < proposed:
            self.rate -= _WEIGHT * self.rate
        self.tried += min(proposed, accepted + 1)

    def held_back(self) -> None:
        """A sequence not proposing this step: its tries fade (the engine's average weighs more)."""
        self.tried *= 1.0 - _RECOVERY

    def unused(self) -> None:
        """An engine-wide kind no proposal tried this step: it drifts back to the prior."""
        self.rate += _RECOVERY * (PRIOR_ACCEPTANCE - self.rate) / 4

    def blended(self, engine: Acceptance) -> float:
        """A sequence's estimate: its own average against the engine's for its kind of proposal."""
        return (engine.rate * _PRIOR_TRIES + self.rate * self.tried) / (_PRIOR_TRIES + self.tried)


def _prior(rows: int) -> float:
    return _FIXED + _PER_ROW * rows


class StepCosts:
    """Seconds per decode step by its number of token rows, as measured (see the module docstring)."""

    def __init__(self) -> None:
        self._samples: dict[int, deque[tuple[int, float]]] = {}  # rows -> (step, seconds), latest last
        self._known: list[int] = []  # sorted row counts with samples
        self._passes: deque[float] = deque(maxlen=_SAMPLES)  # a draft model's passes (seconds)
        self._steps = 0

    def observe_pass(self, seconds: float) -> None:
        if seconds > 0:
            self._passes.append(seconds)

    def pass_estimate(self) -> float:
        """One draft-model pass, in `estimate`'s units."""
        if self._passes and self._known:
            return statistics.median(self._passes)
        return _PASS_PRIOR * self.estimate(1)

    def observe(self, rows: int, seconds: float) -> None:
        if not 0 < rows <= _MAX_ROWS or not seconds > 0:
            return
        self._steps += 1
        if rows not in self._samples:
            self._samples[rows] = deque(maxlen=_SAMPLES)
        self._samples[rows].append((self._steps, seconds))
        if self._steps % 64 == 0 or rows not in self._known:  # forget the row counts not seen lately
            for old in [r for r, samples in self._samples.items() if samples[-1][0] < self._steps - _STALE]:
                del self._samples[old]
            self._known = sorted(self._samples)

    def table(self) -> dict[int, float]:
        """The measured seconds per decode step by row count (the medians `estimate` reads)."""
        return {rows: self._measured(rows) for rows in self._known}

    def _measured(self, rows: int) -> float:
        return statistics.median(seconds for _, seconds in self._samples[rows])

    def estimate(self, rows: int) -> float:
        """A step of `rows` rows in seconds; in one-row steps (the prior alone) before any measurement."""
        if not self._known:
            return _prior(rows)
        if rows in self._samples:
            return self._measured(rows)
        below = [r for r in self._known if r < rows]
        above = [r for r in self._known if r > rows]
        if below and above:
            lo, hi = below[-1], above[0]
            t_lo, t_hi = self._measured(lo), self._measured(hi)
            return t_lo + (t_hi - t_lo) * (rows - lo) / (hi - lo)
        near = below[-1] if below else above[0]
        return self._measured(near) * _prior(rows) / _prior(near)


@dataclass(frozen=True, slots=True)
class Candidate:
    key: int  # the sequence's id
    acceptance: float
    available: int  # tokens it could propose (ngram: found; draft model: its cap)


def plan_drafts(
    candidates: Iterable[Candidate],
    base_rows: int,
    base_tokens: int,
    costs: StepCosts,
    budget: int,
    pass_cost: float = 0.0,
) -> dict[int, int]:
    """Proposed tokens per sequence key (absent: none) for a step of `base_rows` token rows that emits
    `base_tokens` tokens without speculation, at most `budget` proposals in all; `pass_cost`: what
    each proposal depth costs besides its rows (a draft model's forward pass), in the costs' units."""
    heap = [(-c.acceptance, c.key, 1, c) for c in candidates if c.available > 0 and c.acceptance > 0]
    heapq.heapify(heap)
    taken: list[tuple[int, int]] = []  # (key, its proposals so far) in ranking order
    tokens, depth = float(base_tokens), 0
    best_rate, best_len = _MARGIN * tokens / costs.estimate(base_rows), 0
    while heap and len(taken) < budget:
        value, key, i, c = heapq.heappop(heap)
        if -value < _NEGLIGIBLE:
            break
        tokens, depth = tokens - value, max(depth, i)
        taken.append((key, i))
        rate = tokens / (costs.estimate(base_rows + len(taken)) + depth * pass_cost)
        if rate > best_rate:
            best_rate, best_len = rate, len(taken)
        if i < c.available:
            heapq.heappush(heap, (value * c.acceptance, key, i + 1, c))
    return dict(taken[:best_len])  # (a key's later entries overwrite its earlier ones)
