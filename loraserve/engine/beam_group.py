"""A beam-search request's group state and its per-step selection, as transformers' beam search.

The scheduler owns each `BeamGroup` (on `Request.beam`) and is its only writer. A group's live beams
are ordinary `Sequence`s of one request (`Request.seqs`), running in the same batches as everything
else, under the request's adapter. Each round every live beam decodes one token; the runner hands back
the top `k` next-token logprobs of each beam's row (`beam_candidates`); once every live beam of the
group has its candidates, `select` ranks all of them by cumulative logprob as `generate(num_beams=W)`
does: of the best `k` (k = max(2, 1 + number of stop ids) * W), those that end (a stop id, or the
length limit) and rank among the first W become finished hypotheses scored sum_logprobs /
(generated tokens, stop token included) ** length_penalty, the best W unfinished ones continue, and
`early_stopping` (True / False / "never") decides when the search is over. The scheduler then forks
the continuing beams (shared KV blocks) and drops the others.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch

from loraserve.beam_search import beam_score
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.sequence import BeamCandidates, BeamGroup, Hypothesis, Request, Sequence, SequenceStatus


@dataclass(frozen=True, slots=True)
class Continuation:
    parent: Sequence
    token_id: int
    cum_logprob: float


@dataclass(frozen=True, slots=True)
class Selection:
    continuing: list[Continuation]  # best first, at most beam_width
    finished: list[Hypothesis]  # the group's finished hypotheses after this round, best first
    done: bool


def beam_candidates(logits: torch.Tensor, seqs: list[Sequence]) -> list[BeamCandidates]:
    """The top-k log-probabilities (float32 log_softmax, as transformers') of each beam row: rows of
    `logits` whose sequence belongs to a beam group; other rows are not touched."""
    rows = [i for i, seq in enumerate(seqs) if seq.request.beam is not None]
    if not rows:
        return []
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logprobs = torch.log_softmax(logits[index].float(), dim=-1)
    k = min(max(seqs[i].request.beam.k for i in rows), logprobs.shape[1])  # type: ignore[union-attr]
    values, ids = logprobs.topk(k, dim=-1)
    out = []
    for j, (vals, toks) in enumerate(zip(values.tolist(), ids.tolist(), strict=True)):
        seq = seqs[rows[j]]
        group_k = seq.request.beam.k  # type: ignore[union-attr]
        out.append(BeamCandidates(seq, vals[:group_k], toks[:group_k]))
    return out


def select(group: BeamGroup, live: list[Sequence]) -> Selection:
    """One round of transformers' beam search over the live beams' pending candidates (all present)."""
    width, lp = group.width, group.params.length_penalty
    ranked: list[tuple[float, int, int, int]] = []  # (cum logprob, beam, candidate rank, token)
    for b, seq in enumerate(live):
        cands = group.pending[seq.seq_id]
        ranked.extend(
            (seq.cumulative_logprob + v, b, r, t)
            for r, (v, t) in enumerate(zip(cands.logprobs, cands.token_ids))
        )
    ranked.sort(key=lambda c: (-c[0], c[1], c[2]))
    num_generated = live[0].num_output_tokens + 1  # every live beam has the same length
    length_stop = num_generated >= group.max_tokens
    full_and_early = group.params.early_stopping is True and len(group.finished) >= width
    continuing: list[Continuation] = []
    new: list[Hypothesis] = []
    for rank, (cum, b, _, token) in enumerate(ranked[: group.k]):
        parent = live[b]
        if length_stop or token in group.stop_ids:
            if rank < width and not full_and_early:  # only the top W may finish (the rest are spares)
                reason, stop_reason = ("stop", token if token in group.user_stop_ids else None)
                if length_stop and token not in group.stop_ids:
                    reason, stop_reason = "length", None
                score = beam_score(cum, num_generated, lp)
                new.append(Hypothesis([*parent.output_token_ids, token], cum, score, reason, stop_reason))
        elif len(continuing) < width:
            continuing.append(Continuation(parent, token, cum))
    finished = sorted([*group.finished, *new], key=lambda h: -h.score)[:width]
    return Selection(continuing, finished, _is_done(group, continuing, finished, num_generated, length_stop))


def _is_done(
    group: BeamGroup,
    continuing: list[Continuation],
    finished: list[Hypothesis],
    num_generated: int,
    length_stop: bool,
) -> bool:
    """transformers' stopping rule: the length limit; W finished with early_stopping=True; else W
    finished and the best running beam, scored at its current length (at max length for "never"
    with a positive length_penalty), not better than the worst finished one."""
    if length_stop or not continuing:
        return True
    if len(finished) < group.width:
        return False
    stopping, lp = group.params.early_stopping, group.params.length_penalty
    if stopping is True:
        return True
    length = group.max_tokens if stopping == "never" and lp > 0.0 else num_generated
    best_possible = beam_score(continuing[0].cum_logprob, length, lp)
    return not best_possible > finished[-1].score


def apply_selection(
    request: Request,
    selection: Selection,
    blocks: BlockManager,
    queues: tuple[list[Sequence], deque[Sequence]],
    finish: Callable[[Sequence, str], None],
    seq_ids: Iterator[int],
) -> None:
    """The scheduler's half of a round: continuing beams take their token (a parent chosen twice or
    more is forked first: the fork shares its KV blocks and joins its parent's queue, `queues` being
    the scheduler's running and waiting ones: a parked parent waits), parents no continuation chose
    end and leave the request, and a finished search ends every beam. `request.seqs` stays the live
    beams."""
    running, waiting = queues
    group = request.beam
    assert group is not None
    group.pending.clear()
    group.finished = selection.finished
    uses: dict[int, int] = {}
    beams: list[tuple[Sequence, Continuation]] = []
    for cont in selection.continuing:
        parent = cont.parent
        uses[parent.seq_id] = uses.get(parent.seq_id, 0) + 1
        if uses[parent.seq_id] == 1:
            beams.append((parent, cont))
            continue
        child = _fork(parent, next(seq_ids), blocks)
        if parent.status is SequenceStatus.WAITING:  # parked (preempted with its candidates)
            waiting.insert(waiting.index(parent) + 1, child)
        else:
            running.insert(running.index(parent) + 1 if parent in running else len(running), child)
        beams.append((child, cont))
    for seq in list(request.seqs):
        if seq.seq_id not in uses:
            finish(seq, "abort")  # a dropped beam: not reported, its blocks freed
    for index, (seq, cont) in enumerate(beams):  # forks copied their parent before it grows
        seq.token_ids.append(cont.token_id)
        seq.cumulative_logprob = cont.cum_logprob
        seq.index = index
    request.seqs = [seq for seq, _ in beams]
    if selection.done:
        group.done = True
        for seq in request.seqs:
            finish(seq, "stop")


def _fork(parent: Sequence, seq_id: int, blocks: BlockManager) -> Sequence:
    return Sequence(
        seq_id=seq_id,
        request=parent.request,
        index=parent.index,
        token_ids=list(parent.token_ids),
        num_prompt_tokens=parent.num_prompt_tokens,
        generator=None,
        detokenizer=None,
        status=parent.status,
        num_computed_tokens=parent.num_computed_tokens,
        block_ids=blocks.fork(parent, seq_id),
        cumulative_logprob=parent.cumulative_logprob,
        waiting_since_step=parent.waiting_since_step,
    )
