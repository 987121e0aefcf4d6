"""`NgramIndex`: the ngram method's proposals for one sequence, from its own prompt and output.

The proposal continues the sequence as it continued before: the longest suffix of n tokens
(prompt_lookup_max >= n >= prompt_lookup_min) that occurred earlier, at its latest earlier occurrence,
is followed by the tokens that followed it there. A continuation that runs into the suffix itself is a
period, and repeats (so "a b a b" proposes "a b a b ..." rather than stopping at the end).

One dict per n maps each n-gram to where it last ended; tokens appended since the last call are
indexed then (the prompt once, on the first call), so a step costs (new tokens + 1) x (sizes) dict
operations however long the sequence is, and the memory is (tokens) x (sizes) entries, freed with
the sequence. The sequence's tokens only ever grow (preemption keeps them), which the index relies on.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramIndex:
    def __init__(self, min_n: int, max_n: int) -> None:
        if not 1 <= min_n <= max_n:
            raise ValueError(f"n-gram sizes must satisfy 1 <= min <= max, got {min_n}, {max_n}")
        self.sizes = range(max_n, min_n - 1, -1)  # longest first: the first match found is the longest
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams ending at positions < indexed are in the tables
        self.matched = 0  # the n of the last proposal's match (0: none)

    def propose(self, tokens: Sequence[int], k: int) -> list[int]:
        """Up to `k` tokens predicted to follow `tokens` (the whole sequence so far); [] when no suffix
        of an indexed size occurred before."""
        end = len(tokens) - 1  # the suffix ends here; earlier n-grams end before it
        self._index(tokens, end)
        self.matched = 0
        if k <= 0:
            return []
        for n in self.sizes:
            if n > end:  # a match needs n tokens before the one after it
                continue
            last = self.tables[n].get(tuple(tokens[end - n + 1 :]))
            if last is not None:
                self.matched = n
                return _continuation(tokens, last + 1, k)
        return []

    def _index(self, tokens: Sequence[int], end: int) -> None:
        for pos in range(self.indexed, end):
            for n, table in self.tables.items():
                if pos + 1 >= n:
                    table[tuple(tokens[pos - n + 1 : pos + 1])] = pos
        self.indexed = max(self.indexed, end)


def _continuation(tokens: Sequence[int], start: int, k: int) -> list[int]:
    """tokens[start:start + k], continued periodically past the end (the match's period repeats)."""
    out = list(tokens[start : start + k])
    period = len(tokens) - start
    while len(out) < k:  # past the end, so len(out) >= period
        out.append(out[len(out) - period])
    return out
