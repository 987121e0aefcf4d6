"""What the ngram method can reach on an output known in advance: the bound a speculation row is measured
against (benchmarks/speculative.py).

A perfect verifier, replaying the output without speculation: at each step the ngram index
(loraserve.engine.ngram_index, the served proposer, with the run's k and lookup sizes) proposes from the
prompt and the output so far; the step keeps the proposal's prefix that equals the output, plus its own
token. Proposing exactly that prefix (no rejected row) is the most any plan over these proposals gets:
- `free`: the tokens after the first over the steps that emit them, every row free (an upper bound
  whatever the kernels);
- `at_costs`: the same steps timed by the engine's measured cost of a step of 1 + accepted rows,
  against one row per token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from loraserve.engine.ngram_index import NgramIndex


def accepted_per_step(prompt: Sequence[int], output: Sequence[int], k: int, low: int, high: int) -> list[int]:
    """Proposals a perfect verifier keeps at each step after the first token, in order."""
    index, done, kept = NgramIndex(low, high), 1, []
    while done < len(output):
        proposal = index.propose([*prompt, *output[:done]], k)
        right = 0
        while (
            right < len(proposal)
            and done + right < len(output) - 1
            and proposal[right] == output[done + right]
        ):
            right += 1
        kept.append(right)
        done += 1 + right
    return kept


def bounds(kept: Sequence[int], step_seconds: Callable[[int], float]) -> tuple[float, float]:
    """(free, at_costs) speedups over one token a step, for the steps `accepted_per_step` found."""
    if not kept:
        return 1.0, 1.0
    tokens = sum(kept) + len(kept)
    return tokens / len(kept), tokens * step_seconds(1) / sum(step_seconds(1 + a) for a in kept)
