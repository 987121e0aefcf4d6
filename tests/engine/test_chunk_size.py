"""A step's chunk of one sequence (engine/chunk_size.py): the prompt-logprob budget cuts it, a Gemma-3
image (tokens attending both ways) is never split by the step budget nor by the logprob budget (the
image wins: the chunk runs to its end, so a prompt with both always progresses), a LLaVA image may be
split anywhere."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from loraserve.engine.chunk_size import chunk_size
from loraserve.engine.logprob_budget import LogprobBudget
from loraserve.multimodal.inputs import ImageItem, MultiModalInputs

PROMPT = 40
IMAGE = (10, 26)  # the image's placeholder positions [10, 26)


def _seq(computed: int, prompt_logprobs: int | None, bidirectional: bool | None) -> Any:
    mm = None
    if bidirectional is not None:
        image = ImageItem("h", {}, (IMAGE,))
        mm = MultiModalInputs(list(range(PROMPT)), (image,), bidirectional=bidirectional)
    return SimpleNamespace(
        request=SimpleNamespace(mm=mm),
        params=SimpleNamespace(prompt_logprobs=prompt_logprobs),
        num_prompt_tokens=PROMPT,
        num_computed_tokens=computed,
    )


def _budget(rows: int, k: int = 1) -> LogprobBudget:
    """A step budget that leaves `rows` prompt-logprob rows of top-`k`."""
    return LogprobBudget(vocab_size=None, entries_left=rows * (k + 1))


@pytest.mark.parametrize(
    ("computed", "num_new", "logprob_rows", "bidirectional", "expected"),
    [
        (0, 40, None, None, 40),  # text only, no logprobs: the step budget's
        (0, 40, 5, None, 5),  # text only: the logprob budget's
        (0, 15, None, True, 10),  # the step budget would end inside the image: stop before it
        (10, 8, None, True, 0),  # the image does not fit the rest of the step: it waits
        (10, 30, 4, True, 16),  # the logprob budget ends inside the image: the image whole
        (0, 30, 12, True, 10),  # ... after text: stop before the image
        (0, 15, None, False, 15),  # LLaVA's image tokens attend causally: split anywhere
        (0, 30, 12, False, 12),
    ],
)
def test_chunk_size(
    computed: int, num_new: int, logprob_rows: int | None, bidirectional: bool | None, expected: int
) -> None:
    seq = _seq(computed, None if logprob_rows is None else 1, bidirectional)
    budget = _budget(logprob_rows if logprob_rows is not None else 0)
    assert chunk_size(seq, num_new, budget) == expected


def test_the_steps_first_logprob_row_inside_an_image_runs_the_whole_image() -> None:
    """A spent budget still gives the step's first row; inside a Gemma-3 image that is the image."""
    seq = _seq(10, 1, True)
    assert chunk_size(seq, 30, _budget(0)) == 16  # to the image's end at 26
    spent = _budget(0)
    spent.rows_taken = 1  # another sequence took the step's first row
    assert chunk_size(seq, 30, spent) == 0
