"""`Speculator`: speculative decoding's proposals, added to a scheduled step before it runs.

After `Scheduler.schedule()`, `propose(batch)` picks the decoding sequences that may speculate
(sampling or greedy, not beams, not while vLLM's `disable_by_batch_size` is exceeded, never past
max_tokens or max_model_len), asks each one's proposer (its own `NgramIndex`, or
the `DraftModel` after the plan), plans how many tokens each proposes (`spec_policy.plan_drafts`, or
all of them with draft_policy "always"), reserves their KV blocks from free ones only
(`Scheduler.reserve_draft`), draws the rows' sampling noise ahead (`DraftRound`) and hangs the round
on the `ScheduledSeq`: the model runner verifies it in the same forward as everything else.
`observe(...)` after the step feeds each sequence's acceptance and the engine's by kind of proposal,
the step-cost table and the per-adapter counters (`SpecStats`). Per-sequence state lives here, keyed by sequence id, and goes when
its sequence finishes.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from loraserve.config import EngineConfig
from loraserve.engine.engine_stats import adapter_label
from loraserve.engine.ngram_index import NgramIndex
from loraserve.engine.scheduler import Scheduler
from loraserve.engine.sequence import DraftRound, Sequence
from loraserve.engine.spec_policy import Acceptance, Candidate, StepCosts, plan_drafts
from loraserve.engine.spec_stats import SpecStats
from loraserve.engine.spec_verify import Verified
from loraserve.engine.step_types import ScheduledSeq, SchedulerOutput
from loraserve.speculative_config import SpeculativeConfig

if TYPE_CHECKING:
    from loraserve.engine.draft_model import DraftModel

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class SeqSpec:
    """One sequence's speculation state."""

    seq: Sequence
    index: NgramIndex | None  # the ngram method's
    acceptance: Acceptance = field(default_factory=Acceptance)
    kind: int = 0  # its latest proposals' kind: the n-gram match's length (0: a draft model's)


class Speculator:
    def __init__(
        self,
        config: SpeculativeConfig,
        scheduler: Scheduler,
        max_model_len: int,
        vocab_size: int,
        device: torch.device,
        draft: DraftModel | None = None,
    ) -> None:
        self.config = config
        self.scheduler = scheduler
        self.max_model_len = max_model_len if draft is None else min(max_model_len, draft.max_model_len)
        self.vocab_size = vocab_size
        self.device = device
        self.draft = draft
        self.costs = StepCosts()
        self.stats = SpecStats(config.num_speculative_tokens)
        self._seqs: dict[int, SeqSpec] = {}
        self._kinds: dict[int, Acceptance] = {}  # the engine's acceptance by kind of proposal
        self._held: list[SeqSpec] = []  # this step's sequences with proposals the plan left out
        self._draft_seconds = 0.0  # this step's draft-model passes

    # ---- before the step ------------------------------------------------------------------------
    def propose(self, batch: SchedulerOutput) -> None:
        """Add proposals to `batch`'s decoding sequences (see the module docstring)."""
        self._prune()
        self._held, self._draft_seconds = [], 0.0
        limit = self.config.disable_by_batch_size
        if limit is not None and len(self.scheduler.running) + len(self.scheduler.waiting) > limit:
            return
        items = {item.seq.seq_id: item for item in batch.scheduled if _decoding(item)}
        caps = {seq_id: self._cap(item.seq) for seq_id, item in items.items()}
        found: dict[int, list[int]] = {}
        if self.draft is None:
            found = {seq_id: self._ngram(items[seq_id].seq, cap) for seq_id, cap in caps.items() if cap > 0}
        plan = self._plan(
            batch, items, {seq_id: len(f) for seq_id, f in found.items()} if self.draft is None else caps
        )
        rounds: dict[int, tuple[ScheduledSeq, int]] = {}
        for seq_id, num in plan.items():
            item = items[seq_id]
            while num > 0 and not self.scheduler.reserve_draft(item.seq, num):
                num -= 1  # short of free blocks: fewer proposals, never a preemption
            if num > 0:
                rounds[seq_id] = (item, num)
        noise = {seq_id: self._noise(item.seq, num) for seq_id, (item, num) in rounds.items()}
        if self.draft is not None:
            found = self._draft_proposals(rounds, noise)
        for seq_id, (item, num) in rounds.items():
            tokens = found.get(seq_id, [])[:num]
            rows, states = noise[seq_id]
            if not tokens:  # (a draft model that failed): the blocks and a seeded generator's draws go back
                self.scheduler.release_draft(item.seq)
                if states is not None and item.seq.generator is not None:
                    item.seq.generator.set_state(states[0])
                continue
            item.draft = DraftRound(
                tokens,
                None if rows is None else rows[: len(tokens) + 1],
                None if states is None else states[1 : len(tokens) + 2],
            )

    def _draft_proposals(
        self,
        rounds: dict[int, tuple[ScheduledSeq, int]],
        noise: dict[int, tuple[torch.Tensor | None, list[torch.Tensor] | None]],
    ) -> dict[int, list[int]]:
        """The draft model's proposals; none this step if it fails (the requests go on without)."""
        assert self.draft is not None
        begin = time.perf_counter()
        try:
            return self.draft.propose(
                [(item.seq, num, noise[seq_id][0]) for seq_id, (item, num) in rounds.items()]
            )
        except Exception:  # noqa: BLE001 - a draft's failure costs this step its proposals, nothing else
            logger.exception("The draft model failed; this step runs without proposals")
            return {}
        finally:
            self._draft_seconds = time.perf_counter() - begin

    def _prune(self) -> None:
        for seq_id in [seq_id for seq_id, spec in self._seqs.items() if spec.seq.is_finished]:
            del self._seqs[seq_id]
        if self.draft is not None:
            self.draft.release_finished()

    def _state(self, seq: Sequence) -> SeqSpec:
        spec = self._seqs.get(seq.seq_id)
        if spec is None:
            index = None
            if self.draft is None:
                index = NgramIndex(self.config.prompt_lookup_min, self.config.prompt_lookup_max)
            spec = self._seqs[seq.seq_id] = SeqSpec(seq, index)
        return spec

    def _cap(self, seq: Sequence) -> int:
        """Most tokens `seq` may propose: every proposal could be emitted, plus the target's own token."""
        params = seq.params
        left = self.max_model_len - seq.num_tokens
        if params.max_tokens is not None:
            left = min(left, params.max_tokens - seq.num_output_tokens)
        return max(0, min(self.config.num_speculative_tokens, left - 1))

    def _ngram(self, seq: Sequence, cap: int) -> list[int]:
        state = self._state(seq)
        if state.index is None:
            return []
        found = state.index.propose(seq.token_ids, cap)
        state.kind = state.index.matched
        return found

    def _kind(self, kind: int) -> Acceptance:
        acceptance = self._kinds.get(kind)
        if acceptance is None:
            acceptance = self._kinds[kind] = Acceptance()
        return acceptance

    def _plan(
        self, batch: SchedulerOutput, items: dict[int, ScheduledSeq], available: dict[int, int]
    ) -> dict[int, int]:
        """Proposals per sequence id: all it has under "always", else what `plan_drafts` finds pays."""
        wanted = {seq_id: num for seq_id, num in available.items() if num > 0}
        budget = self.scheduler.config.max_num_batched_tokens - sum(
            i.num_query_tokens for i in batch.scheduled
        )
        if self.config.draft_policy == "always":
            plan: dict[int, int] = {}
            for seq_id, num in wanted.items():
                plan[seq_id] = min(num, budget)
                budget -= plan[seq_id]
            return {seq_id: num for seq_id, num in plan.items() if num > 0}
        states = {seq_id: self._state(items[seq_id].seq) for seq_id in wanted}
        candidates = [
            Candidate(seq_id, states[seq_id].acceptance.blended(self._kind(states[seq_id].kind)), num)
            for seq_id, num in wanted.items()
        ]
        base_rows = sum(item.num_query_tokens for item in batch.scheduled)
        base_tokens = sum(1 for item in batch.scheduled if _samples(item))
        pass_cost = self.costs.pass_estimate() if self.draft is not None else 0.0
        plan = plan_drafts(candidates, base_rows, base_tokens, self.costs, budget, pass_cost)
        self._held = [states[seq_id] for seq_id in wanted if seq_id not in plan]
        return plan

    def _noise(self, seq: Sequence, num: int) -> tuple[torch.Tensor | None, list[torch.Tensor] | None]:
        """The Exponential(1) draws of a sampled sequence's num + 1 rows (from its generator when
        seeded, keeping its state before them and after each); (None, None) for a greedy one."""
        if seq.params.is_greedy:
            return None, None
        rows = torch.empty(num + 1, self.vocab_size, device=self.device)
        generator = seq.generator
        if generator is None:
            return rows.exponential_(), None
        states = [generator.get_state()]  # before the draws, then after each
        for row in rows:  # one row-sized draw at a time, as the sampler draws a seeded row
            row.exponential_(generator=generator)
            states.append(generator.get_state())
        return rows, states

    # ---- after the step -------------------------------------------------------------------------
    def observe(self, scheduled: list[ScheduledSeq], emitted: list[Verified], seconds: float) -> None:
        """What the step did: the proposals' acceptance (per sequence and per adapter) and, for a step
        of decodes only, its cost by row count."""
        if scheduled and all(item.num_new_tokens == 1 for item in scheduled):
            rows = sum(item.num_query_tokens for item in scheduled)
            self.costs.observe(rows, seconds - self._draft_seconds)
            if self._draft_seconds > 0:
                depth = max((len(item.draft_tokens) for item in scheduled), default=0)
                if depth:
                    self.costs.observe_pass(self._draft_seconds / depth)
        tried: set[int] = set()
        for out in emitted:
            if out.num_draft:
                state = self._state(out.seq)
                state.acceptance.observe(out.num_draft, out.num_accepted)
                self._kind(state.kind).observe(out.num_draft, out.num_accepted)
                tried.add(state.kind)
                self.stats.record(
                    adapter_label(out.seq.request.lora_request), out.num_draft, out.num_accepted
                )
        for spec in self._held:
            spec.acceptance.held_back()
        for kind, acceptance in self._kinds.items():
            if kind not in tried:
                acceptance.unused()
        self._held = []
        self._prune()  # finished sequences' state (and a draft model's KV) goes now, not at the next step


def build_speculator(
    config: EngineConfig, scheduler: Scheduler, num_blocks: int, eos_token_id: int | None, tokenizer: Any
) -> Speculator | None:
    """The engine's speculative decoding (None without a speculative config), its draft model loaded
    (`num_blocks` KV blocks of its own, as many as the target's)."""
    spec = config.speculative
    if spec is None:
        return None
    draft = None
    if spec.method == "draft_model":
        from loraserve.engine.draft_model import DraftModel

        draft = DraftModel(config, spec, num_blocks, eos_token_id, tokenizer)
    return Speculator(
        spec, scheduler, config.model.max_model_len, config.model.vocab_size, config.device, draft
    )


def _decoding(item: ScheduledSeq) -> bool:
    """A sequence computing just its last sampled token, which may speculate (beams do not)."""
    seq = item.seq
    return (
        item.num_new_tokens == 1
        and item.draft is None
        and seq.num_computed_tokens + 1 == seq.num_tokens
        and seq.num_output_tokens > 0
        and seq.request.beam is None
    )


def _samples(item: ScheduledSeq) -> bool:
    seq = item.seq
    return seq.num_computed_tokens + item.num_new_tokens == seq.num_tokens
