"""benchmarks.spec_bound: the ngram method's bound on a known output, step by step."""

from __future__ import annotations

from benchmarks.spec_bound import accepted_per_step, bounds


def test_a_copied_span_is_kept_in_one_step_and_nothing_else_is() -> None:
    prompt = [1, 2, 3, 4, 5, 6, 7, 8]
    # the first token is the prefill's; "9 1" matches nothing; "1 2" matches the prompt, whose rest is kept
    # up to the last token (a step's own token is always the model's)
    output = [9, 1, 2, 3, 4, 5, 6, 7, 8]
    assert accepted_per_step(prompt, output, 8, 2, 5) == [0, 0, 5]
    assert accepted_per_step(prompt, output, 3, 2, 5) == [0, 0, 3, 1]  # k caps a step's proposals
    free, timed = bounds([0, 0, 5], lambda rows: 1.0 + 0.5 * (rows - 1))
    assert free == 8 / 3
    assert timed == 8 * 1.0 / (1.0 + 1.0 + 3.5)


def test_an_output_with_nothing_to_copy_is_bound_at_one() -> None:
    kept = accepted_per_step([1, 2, 3], [7, 8, 9, 10], 8, 2, 5)
    assert kept == [0, 0, 0]
    assert bounds(kept, lambda rows: float(rows)) == (1.0, 1.0)
    assert bounds([], lambda rows: float(rows)) == (1.0, 1.0)
