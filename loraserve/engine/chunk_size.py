"""How many of a sequence's next tokens one step computes, within what the step's token budget left:
fewer where the step's prompt-logprob budget (`LogprobBudget`) runs out, and never ending inside an
image whose tokens attend to each other both ways (Gemma-3's: the whole image must be in the cache when
its rows are computed). An image wins over the logprob budget: a chunk the budget would cut inside
one runs to the image's end (one image at most, and an image never exceeds the step budget:
`check_image_runs`), so a prompt with images and prompt logprobs always progresses."""

from __future__ import annotations

from loraserve.engine.logprob_budget import LogprobBudget
from loraserve.engine.sequence import Sequence
from loraserve.multimodal.inputs import MultiModalInputs


def chunk_size(seq: Sequence, num_new: int, logprobs: LogprobBudget) -> int:
    """At most `num_new` (0 when nothing of `seq` can run this step)."""
    whole = _outside_images(seq, num_new)
    taken = logprobs.take(seq, whole)
    if taken == whole:
        return taken
    cut = _outside_images(seq, taken)
    mm = seq.request.mm
    if cut == 0 and taken > 0 and mm is not None:
        return _image_end(mm, seq.num_computed_tokens, taken)
    return cut


def _outside_images(seq: Sequence, num_new: int) -> int:
    mm = seq.request.mm
    if mm is None or not mm.bidirectional:
        return num_new
    start = seq.num_computed_tokens
    return mm.clamp_chunk(start, start + num_new) - start


def _image_end(mm: MultiModalInputs, start: int, num_new: int) -> int:
    """`num_new` extended to the end of the image it ends inside."""
    end = start + num_new
    for run_start, run_end in mm.runs():
        if run_start < end < run_end:
            return run_end - start
    return num_new
