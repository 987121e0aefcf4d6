"""Fair batch slots: how many of `max_num_seqs` one request's sequences may hold while others wait.

A request's sequences (its n samples, best_of or beams, and the prompts of its API call, which share
a turn key) all finish together, so a newcomer that waits for "the first of them to finish" waits for
the whole request: one request of 128 sequences made a 2-token request wait two minutes. With
`max_num_seqs_share` below 1, while sequences of another request wait for a slot, one turn key holds
at most `cap` = floor(share x max_num_seqs) (at least 1) running sequences:
- `to_yield` picks what to give back before a step: the over-share keys' latest sequences (beams
  that already hold this round's candidates first: they lose nothing but a recompute of their last
  block), as many as the waiting sequences within their own share need;
- `may_admit` keeps an over-share key from taking slots back while others still wait.
Alone, a request uses every slot (vLLM's behaviour, which share 1.0 keeps in every case).
Also: a beam that holds its round's candidates does no work this round, so when slots are short it
yields its slot to one that has work (`idle_beams`); its candidates wait with it.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Iterable

from loraserve.config import SchedulerConfig
from loraserve.engine.sequence import Sequence


def is_parked(seq: Sequence) -> bool:
    """A beam whose candidates for this round are in: it needs no compute until its group's round."""
    beam = seq.request.beam
    return beam is not None and seq.seq_id in beam.pending


class FairSlots:
    def __init__(self, config: SchedulerConfig) -> None:
        self.config = config
        self.cap = max(1, math.floor(config.max_num_seqs * config.max_num_seqs_share))
        self.enabled = config.max_num_seqs_share < 1.0

    def wanting(
        self, waiting: Iterable[Sequence], held: Counter[str], fits: Callable[[Sequence], bool]
    ) -> int:
        """Waiting sequences (not parked, whose adapter fits) that their key's share lets in."""
        room: Counter[str] = Counter()
        count = 0
        for seq in waiting:
            key = seq.request.turn_key
            if is_parked(seq) or not fits(seq):
                continue
            if not self.enabled or held[key] + room[key] < self.cap:
                room[key] += 1
                count += 1
        return count

    def to_yield(
        self, running: list[Sequence], waiting: list[Sequence], fits: Callable[[Sequence], bool]
    ) -> list[Sequence]:
        """Running sequences to give back (preempt) before this step so that waiting ones within their
        share get a slot; idle beams go first, then the latest of the keys most over their share."""
        free = self.config.max_num_seqs - len(running)
        held = Counter(seq.request.turn_key for seq in running)
        need = self.wanting(waiting, held, fits) - free
        if need <= 0:
            return []
        chosen: list[Sequence] = []
        idle = [seq for seq in reversed(running) if is_parked(seq)]
        waiting_keys = {seq.request.turn_key for seq in waiting if not is_parked(seq)}
        for seq in idle:  # a beam with its candidates in yields to work, its own group's included
            if len(chosen) >= need:
                return chosen
            key = seq.request.turn_key
            if key in waiting_keys or (self.enabled and held[key] > self.cap):
                chosen.append(seq)
                held[key] -= 1
        if not self.enabled:
            return chosen
        taken = set(map(id, chosen))
        # Under the priority policy a request yields only to waiting ones of its level or better.
        best = min((s.request.priority for s in waiting if not is_parked(s)), default=0)
        while len(chosen) < need:
            over = {k: n for k, n in held.items() if n > self.cap}
            candidates = [
                s
                for s in reversed(running)
                if s.request.turn_key in over and id(s) not in taken and s.request.priority >= best
            ]
            if not candidates:
                break
            key = max((s.request.turn_key for s in candidates), key=lambda k: (over[k], k))
            seq = next(s for s in candidates if s.request.turn_key == key)
            chosen.append(seq)
            taken.add(id(seq))
            held[key] -= 1
        return chosen

    def may_admit(self, seq: Sequence, held: Counter[str], waiting_keys: set[str]) -> bool:
        """Whether `seq` may take a slot now: always alone; beyond its key's share not while another
        key's sequences wait."""
        key = seq.request.turn_key
        return not self.enabled or held[key] < self.cap or not (waiting_keys - {key})
