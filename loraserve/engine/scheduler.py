"""Continuous batching and the sequence lifecycle: which sequences run this step, how many tokens
each, and what the step did to them.

The scheduler is the only writer of a `Sequence`. `schedule()` admits, chunks and preempts;
`update()` applies a finished step (computed tokens, committed prefix blocks, sampled tokens, finished
sequences freed), as nano-vllm's `postprocess`; `finish()` ends one early (abort, failed adapter,
failed step); `check_consistency()` cross-checks its queues against the block manager.

One token budget per step (`max_num_batched_tokens`) is shared by decodes and (chunked) prefills.
Running sequences go first, in arrival order; when KV blocks run out the latest-arrived running
sequence is preempted (its blocks freed, recomputed later). Waiting sequences are admitted while the
budget, `max_num_seqs`, free blocks and the `max_loras` distinct-adapter limit allow, requests taking
turns (FCFS within a turn), so one request with hundreds of sequences cannot starve a later short one. A waiting
sequence held back by the adapter limit lets others with already-active adapters pass only for a
bounded number of steps, so it never starves. When more adapters wait than slots are free, the free
slots go first to the adapters with the most waiting requests (one slot then serves many sequences,
so fewer swaps serve the same traffic), except that a sequence waiting for MAX_LORA_REORDER_STEPS
steps keeps its arrival-order place; with the bypass above, a sequence held back by adapters waits at
most about MAX_LORA_REORDER_STEPS + MAX_LORA_BYPASS_STEPS steps for its turn at a slot.

Fair slots (`fair_slots.py`): while another request's sequences wait for a slot, one request's
hold at most `max_num_seqs_share` of `max_num_seqs`; before a step the latest of an over-share
request's sequences yield (preempted, recomputed later), and a beam that already holds its round's
candidates yields first (it keeps them, parked in the waiting queue until its group's round). A
step's prompt-logprob rows are bounded (`logprob_budget.py`), so a long prompt asking for them is
prefilled in small chunks and the rest of the step goes to others.

With `scheduling_policy="priority"` (vLLM's) the waiting queue is served level by level, lower
`Request.priority` first, the turns and adapter-demand order above applying within a level; running
sequences are kept in (priority, arrival) order, so the one preempted is the lowest-priority latest.
"""

from __future__ import annotations

import itertools
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from collections.abc import Sequence as Sequence_

from loraserve.config import SchedulerConfig
from loraserve.engine.admission import QueueLoad
from loraserve.engine.beam_group import apply_selection, select
from loraserve.engine.block_manager import BlockManager
from loraserve.engine.chunk_size import chunk_size
from loraserve.engine.fair_slots import FairSlots, is_parked
from loraserve.engine.logprob_budget import LogprobBudget
from loraserve.engine.sequence import BeamCandidates, Request, Sequence, SequenceStatus
from loraserve.engine.step_types import SampledToken, ScheduledSeq, SchedulerOutput
from loraserve.engine.turn_order import MAX_LORA_REORDER_STEPS, by_adapter_demand, turn_order

__all__ = [
    "MAX_LORA_BYPASS_STEPS",
    "MAX_LORA_REORDER_STEPS",
    "SampledToken",
    "ScheduledSeq",
    "Scheduler",
    "SchedulerOutput",
]

MAX_LORA_BYPASS_STEPS = 8


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        max_loras: int | None,
        can_activate: Callable[[set[int]], bool] | None = None,
        seq_ids: Iterator[int] | None = None,
        vocab_size: int | None = None,
    ) -> None:
        self.config = config
        self.blocks = block_manager
        self.max_loras = max_loras
        # Asks the LoRA manager whether a set of adapters fits its slots (pinned adapters hold theirs).
        self.can_activate = can_activate
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.num_preemptions = 0
        self.num_steps = 0
        self.seq_ids = seq_ids if seq_ids is not None else itertools.count()  # ids for forked beams
        self.fair = FairSlots(config)  # one request's share of the slots while others wait
        self.vocab_size = vocab_size  # bounds a step's prompt-logprob rows (LogprobBudget)
        self.num_yielded = 0  # sequences preempted so that another request's could run

    def add(self, seq: Sequence) -> None:
        seq.waiting_since_step = self.num_steps
        self.waiting.append(seq)

    def queue_load(self) -> QueueLoad:
        """Sequences in flight and the prompt tokens they still have to prefill (admission control)."""
        seqs = [*self.waiting, *self.running]
        prefill = sum(max(seq.num_prompt_tokens - seq.num_computed_tokens, 0) for seq in seqs)
        return QueueLoad(len(seqs), prefill)

    def schedule(self) -> SchedulerOutput:
        self.num_steps += 1
        out = SchedulerOutput()
        logprobs = LogprobBudget(self.vocab_size)
        if self.waiting:
            loras = self._active_loras()
            for seq in self.fair.to_yield(
                self.running, list(self.waiting), lambda s: self._lora_fits(loras, s.lora_id)
            ):
                self._preempt(seq, out, for_blocks=False)
                self.num_yielded += 1
        budget = self._schedule_running(out, self.config.max_num_batched_tokens, logprobs)
        if not out.preempted:
            self._schedule_waiting(out, budget, logprobs)
        return out

    def update(
        self,
        scheduled: list[ScheduledSeq],
        sampled: list[SampledToken],
        beams: Sequence_[BeamCandidates] = (),
        failed: dict[Request, Exception] | None = None,
    ) -> list[Request]:
        """Apply a step that ran: each sequence's sampled tokens, then its computed tokens (proposals
        the step accepted included) and their full blocks, the blocks that held only rejected proposals
        given back; then the beams' candidates (a group whose every live beam has them takes its
        round). Returns the beam-search requests whose search ended. With `failed`, a group whose
        round raises goes into it (the caller ends it) and the other groups go on."""
        tokens: dict[int, list[SampledToken]] = {}
        for token in sampled:
            tokens.setdefault(token.seq.seq_id, []).append(token)
        for item in scheduled:
            seq = item.seq
            own = tokens.pop(seq.seq_id, [])
            for token in own:
                _append(token)
            # The KV of proposal i is right when the token emitted before it equals it: all but the last.
            accepted = min(len(item.draft_tokens), max(len(own) - 1, 0))
            seq.num_computed_tokens += item.num_new_tokens + accepted
            reason = own[-1].finish_reason if own else None
            self.blocks.commit_computed(seq, seq.request.cache_salt, reason is not None)
            if item.draft is not None:
                keep = -(-seq.num_tokens // self.blocks.block_size)
                seq.block_ids = self.blocks.release_tail(seq.block_ids, keep)
            if reason is not None:
                self.finish(seq, reason, own[-1].stop_reason)
        ended = []
        for request in dict.fromkeys(c.seq.request for c in beams if not c.seq.is_finished):
            group = request.beam
            assert group is not None
            for cand in beams:
                if cand.seq.request is request:
                    group.pending[cand.seq.seq_id] = cand
            if all(seq.seq_id in group.pending for seq in request.seqs):
                try:
                    apply_selection(
                        request,
                        select(group, request.seqs),
                        self.blocks,
                        (self.running, self.waiting),
                        self.finish,
                        self.seq_ids,
                    )
                except Exception as exc:
                    if failed is None:
                        raise
                    failed[request] = exc
                    continue
                if group.done:
                    ended.append(request)
        return ended

    def reserve_draft(self, seq: Sequence, num_tokens: int) -> bool:
        """KV blocks for `num_tokens` proposed positions after a decoding sequence's scheduled token,
        from free blocks only (a proposal never preempts anyone); False, with nothing changed, if short.
        `update` gives back the blocks that end up holding only rejected proposals."""
        block_ids = self.blocks.allocate(seq, 1 + num_tokens)
        if block_ids is None:
            return False
        seq.block_ids.extend(block_ids)
        return True

    def release_draft(self, seq: Sequence) -> None:
        """Give back what `reserve_draft` took when no proposal comes of it."""
        seq.block_ids = self.blocks.release_tail(seq.block_ids, -(-seq.num_tokens // self.blocks.block_size))

    def finish(self, seq: Sequence, reason: str, stop_reason: int | str | None = None) -> None:
        """End `seq` (stop, length or abort) and free its blocks."""
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        self._free(seq)

    def check_consistency(self, unfinished: list[Sequence]) -> str | None:
        """What is wrong with the queues or the KV blocks they hold, given the engine's unfinished
        sequences; None if all is consistent."""
        for seq in self.running:
            if seq.status is not SequenceStatus.RUNNING:
                return f"sequence {seq.seq_id} is in the running queue with status {seq.status.name}"
        for seq in self.waiting:
            if seq.status is not SequenceStatus.WAITING:
                return f"sequence {seq.seq_id} is in the waiting queue with status {seq.status.name}"
        live = [*self.running, *self.waiting]
        if len({seq.seq_id for seq in live}) != len(live):
            return "a sequence is queued twice"
        if {seq.seq_id for seq in live} != {seq.seq_id for seq in unfinished}:
            return "the queued sequences are not the unfinished sequences of the engine's requests"
        return self.blocks.check_consistency(seq.block_ids for seq in live)

    def _schedule_running(self, out: SchedulerOutput, budget: int, logprobs: LogprobBudget) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            num_new = chunk_size(seq, min(seq.num_tokens - seq.num_computed_tokens, budget), logprobs)
            if num_new == 0:  # a beam waiting for its group's other beams, or an image the budget cannot hold
                i += 1
                continue
            while not self._allocate(seq, num_new, out.block_copies):
                victim = self.running[-1]
                self._preempt(victim, out)
                if victim is seq:
                    break
            else:
                out.scheduled.append(ScheduledSeq(seq, num_new))
                budget -= num_new
                i += 1
                continue
            break  # `seq` itself was preempted: nothing after it can run either
        return budget

    def _preempt(self, seq: Sequence, out: SchedulerOutput, for_blocks: bool = True) -> None:
        """Back to waiting, blocks freed (recomputed later). A beam keeps this round's candidates, if
        it has them: its tokens have not changed, and it waits, parked, until its group's round.
        `for_blocks=False`: it yields its slot to another request (`FairSlots`), and admission goes on."""
        self.running.remove(seq)
        if out.block_copies:
            own = set(seq.block_ids)
            out.block_copies = [(src, dst) for src, dst in out.block_copies if dst not in own]
        self._free(seq)
        seq.num_computed_tokens = 0
        seq.status = SequenceStatus.WAITING
        seq.waiting_since_step = self.num_steps
        self.waiting.appendleft(seq)
        if for_blocks:
            out.preempted.append(seq)
        out.scheduled = [s for s in out.scheduled if s.seq is not seq]
        self.num_preemptions += 1

    def _active_loras(self) -> set[int]:
        return {seq.lora_id for seq in self.running if seq.lora_id}

    def adapters_in_demand(self) -> list[int]:
        """The adapters unfinished sequences use, soonest needed first (the LoRA host cache evicts
        them last, the last first): the running ones', then the waiting ones' by how many sequences
        wait for each (free slots go to the busiest adapter first), arrival order between equals."""
        running = dict.fromkeys(seq.lora_id for seq in self.running if seq.lora_id)
        waiting = Counter(seq.lora_id for seq in self.waiting if seq.lora_id and seq.lora_id not in running)
        return [*running, *(lora_id for lora_id, _ in waiting.most_common())]

    def _schedule_waiting(self, out: SchedulerOutput, budget: int, logprobs: LogprobBudget) -> None:
        loras = self._active_loras()
        blocked_head: Sequence | None = None
        admitted: list[Sequence] = []
        held = Counter(seq.request.turn_key for seq in self.running)
        waiting_keys = {seq.request.turn_key for seq in self.waiting if not is_parked(seq)}
        for seq in self._admission_order():
            if budget <= 0 or len(self.running) + len(admitted) >= self.config.max_num_seqs:
                break
            if is_parked(seq) or not self.fair.may_admit(seq, held, waiting_keys):
                continue  # a parked beam waits for its round; an over-share request for the others
            lora_id = seq.lora_id
            if not self._lora_fits(loras, lora_id):
                if blocked_head is None:
                    blocked_head = seq
                    seq.num_skipped_for_lora += 1
                    if seq.num_skipped_for_lora > MAX_LORA_BYPASS_STEPS:
                        break  # strict FCFS until the starved request fits
                continue
            num_new = self._admit_tokens(seq, budget, logprobs)
            if num_new == 0:
                break
            held[seq.request.turn_key] += 1
            self.waiting.remove(seq)
            seq.status = SequenceStatus.RUNNING
            if seq.request.first_scheduled_time is None:  # vLLM's queue time; usage's cached_tokens
                seq.request.first_scheduled_time = time.time()
                seq.request.num_cached_tokens = seq.num_computed_tokens
            admitted.append(seq)
            out.scheduled.append(ScheduledSeq(seq, num_new))
            budget -= num_new
            if lora_id:
                loras.add(lora_id)
        self.running.extend(admitted)
        if self._by_priority:  # running in priority order: the last one, preempted first, is the lowest
            self.running.sort(key=_priority_key)

    @property
    def _by_priority(self) -> bool:
        return self.config.scheduling_policy == "priority"

    def _admission_order(self) -> list[Sequence]:
        """The turn order; with the priority policy, level by level (lower first), each level in its
        own turn order and adapter-demand order."""
        order = self._turn_order()
        if self.max_loras is None:
            return order
        if not self._by_priority:
            return self._by_adapter_demand(order)
        levels: dict[int, list[Sequence]] = {}
        for seq in order:  # `order` is sorted by priority already
            levels.setdefault(seq.request.priority, []).append(seq)
        return [seq for level in levels.values() for seq in self._by_adapter_demand(level)]

    def _by_adapter_demand(self, order: list[Sequence]) -> list[Sequence]:
        return by_adapter_demand(order, self._active_loras(), self._adapters_fit, self.num_steps)

    def _turn_order(self) -> list[Sequence]:
        return turn_order(self.waiting, self.running, self._by_priority)

    def _lora_fits(self, loras: set[int], lora_id: int) -> bool:
        """Whether a sequence of adapter `lora_id` (0: none) can join a step that uses `loras`."""
        return not lora_id or lora_id in loras or self._adapters_fit(loras | {lora_id})

    def _adapters_fit(self, lora_ids: set[int]) -> bool:
        """The scheduler's one capacity rule for adapters: whether `lora_ids` can hold compute slots
        at once. The LoRA manager's `can_activate` decides (pinned adapters hold their slots), else
        `max_loras` alone."""
        if self.max_loras is None:
            return True
        if self.can_activate is not None:
            return self.can_activate(lora_ids)
        return len(lora_ids) <= self.max_loras

    def _admit_tokens(self, seq: Sequence, budget: int, logprobs: LogprobBudget) -> int:
        """Attach cached prefix blocks and allocate for the first chunk; 0 if it cannot start now."""
        if not seq.block_ids:
            seq.block_ids = self.blocks.reuse_cached_prefix(seq, seq.request.cache_salt)
            seq.num_computed_tokens = len(seq.block_ids) * self.blocks.block_size
        num_new = seq.num_tokens - seq.num_computed_tokens
        if num_new > budget:
            if not self.config.enable_chunked_prefill:
                self._release_prefix(seq)
                return 0
            num_new = budget
        num_new = chunk_size(seq, num_new, logprobs)
        if num_new == 0 or not self._allocate(seq, num_new):
            self._release_prefix(seq)
            return 0
        return num_new

    def _release_prefix(self, seq: Sequence) -> None:
        self._free(seq)
        seq.num_computed_tokens = 0

    def _allocate(
        self, seq: Sequence, num_new_tokens: int, copies: list[tuple[int, int]] | None = None
    ) -> bool:
        """Blocks for `num_new_tokens` more tokens, and a private copy of a shared partial block the
        first of them goes into (recorded in `copies`); False, with nothing changed, if short."""
        shared = self.blocks.shared_write_block(seq) if copies is not None else None
        needed = self.blocks.blocks_needed(seq, num_new_tokens) + (shared is not None)
        if needed > self.blocks.num_free_blocks:
            return False
        if shared is not None and copies is not None:
            source = seq.block_ids[shared]
            seq.block_ids[shared] = self.blocks.copy_on_write(source)
            copies.append((source, seq.block_ids[shared]))
        block_ids = self.blocks.allocate(seq, num_new_tokens)
        assert block_ids is not None
        seq.block_ids.extend(block_ids)
        return True

    def _free(self, seq: Sequence) -> None:
        self.blocks.free(seq)
        seq.block_ids = []


def _append(token: SampledToken) -> None:
    seq = token.seq
    seq.token_ids.append(token.token_id)
    if token.logprob is not None:  # None unless logprobs were asked for, the only time it is reported
        seq.cumulative_logprob += token.logprob
    if token.top_logprobs is not None:
        if seq.logprobs is None:
            seq.logprobs = []
        seq.logprobs.append(token.top_logprobs)


def _priority_key(seq: Sequence) -> tuple[int, float]:
    """vLLM's priority order: lower `priority` first, then earlier arrival."""
    return seq.request.priority, seq.request.arrival_time
