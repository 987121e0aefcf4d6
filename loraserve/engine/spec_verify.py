"""Speculative decoding's verification: from one sampled token per logits row to the tokens each
sequence emits this step.

A speculating sequence has a row at its own last token and one at each proposed token; the sampler
drew every row's token exactly as it would have without speculation (the same history, filters and
noise: `DraftRound`), given that the proposals before it were sampled. So the tokens are emitted while
the target's own sample at a row equals the next proposal, and the first disagreeing sample (or the
one after the last proposal) is emitted too: the output is the one the sequence would have sampled
step by step, token for token. For greedy rows this is the argmax match; for a sampled row whose
proposal is a point mass (the ngram method) a proposal is accepted with the target's probability of
it, and on rejection the token is distributed as the target's distribution without it: the standard
point-mass rejection rule, realised by the sampler's own Exponential race. A draft model proposes
with the same noise (coupled draws), so its proposals agree with the target where both distributions
put their mass. A seeded sequence's generator is wound back to just after the draws of the emitted
tokens, so its next step draws what it would have drawn without speculation.

Logprobs are the target's (the rows' own). A grammar's dead-end row ends the sequence there.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from loraserve.engine.model_runner import StepResult
from loraserve.engine.sampler import SamplerOutput
from loraserve.engine.sequence import Sequence
from loraserve.outputs import Logprob


@dataclass(slots=True)
class Verified:
    """What one sequence emits this step, in order, with the target's logprobs of each token."""

    seq: Sequence
    token_ids: list[int]
    logprobs: list[float | None]
    top_logprobs: list[dict[int, Logprob] | None]
    num_draft: int = 0  # tokens proposed for it this step
    num_accepted: int = 0  # of them, those emitted (the last token emitted is the target's own)
    dead_end: bool = False  # the last token was sampled at a grammar's dead end: it stops the sequence


def verify(
    result: StepResult, sampled: SamplerOutput, dead_offsets: Mapping[int, int] | None = None
) -> list[Verified]:
    """Group the sampled rows by sequence and keep each one's agreeing prefix. `dead_offsets`: seq_id ->
    the row offset of its first grammar dead end (`MaskJob.dead_offsets`)."""
    out: list[Verified] = []
    seqs, row = result.sample_seqs, 0
    while row < len(seqs):
        seq = seqs[row]
        draft = result.drafts.get(seq.seq_id)
        proposed = draft.tokens if draft is not None else []
        end = row + len(proposed) + 1
        tokens = sampled.token_ids[row:end]
        accepted = 0
        while accepted < len(proposed) and tokens[accepted] == proposed[accepted]:
            accepted += 1
        if draft is not None and draft.states is not None and seq.generator is not None:
            seq.generator.set_state(draft.states[accepted])  # just after the emitted tokens' draws
        emitted = accepted + 1
        dead = (dead_offsets or {}).get(seq.seq_id)
        if dead is not None and dead < emitted:
            emitted = dead + 1
        none: list[Any] = [None] * emitted
        logprobs = sampled.logprobs[row : row + emitted] if sampled.logprobs else none
        tops = sampled.top_logprobs[row : row + emitted] if sampled.top_logprobs else none
        out.append(
            Verified(seq, tokens[:emitted], logprobs, tops, len(proposed), emitted - 1, dead == emitted - 1)
        )
        row = end
    return out
