"""The engine's structured-output side: compiling a request's constraint, giving each sequence its
grammar state, and each step's masks, filled while the model runs and applied before sampling.

`start_step(scheduled)` (right after `schedule()`) hands the constrained sequences that will sample
this step to one worker thread, which advances each grammar over the tokens the sequence gained and
fills its bitmask row; the forward pass runs meanwhile. `apply(job, logits, seqs)` (before the
sampler) waits for it and masks the constrained rows in one operation; the other rows are untouched
and a step without grammars does nothing at all. A sequence whose grammar allows nothing more (a dead
end) samples its stop token and ends with finish_reason "stop", its reason logged. A sequence with
proposed tokens (speculative decoding) has a row at each of them, masked as if the tokens before it
had been sampled (`GrammarState.fill_ahead`); rows are keyed by (sequence, row offset).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from loraserve.json_limits import JSONDepthError
from loraserve.structured_output.grammar_compile import GrammarCompileError, check_budget
from loraserve.structured_output.grammar_state import GrammarState
from loraserve.structured_output.params import GrammarKey, StructuredOutputsParams
from loraserve.structured_output.token_mask import disallowed_tokens, mask_rows

logger = logging.getLogger(__name__)


class ConstrainedSeq(Protocol):
    """What the manager reads of a sequence (engine/sequence.py's `Sequence`)."""

    seq_id: int
    grammar: GrammarState | None
    num_computed_tokens: int

    @property
    def num_tokens(self) -> int: ...

    @property
    def output_token_ids(self) -> list[int]: ...


class ScheduledItem(Protocol):
    @property
    def seq(self) -> Any: ...

    @property
    def num_new_tokens(self) -> int: ...

    @property
    def draft_tokens(self) -> list[int]: ...


@dataclass(slots=True)
class FilledMasks:
    """What the worker made: row j is sequence j's; `reasons[j]` why it can go no further (or None)."""

    disallowed: torch.Tensor  # [rows, vocab] bool
    reasons: list[str | None]


@dataclass(slots=True)
class MaskJob:
    """One step's masks, row j for row `offsets[j]` (0 but for proposed tokens' rows) of `seq_ids[j]`."""

    seq_ids: list[int]
    future: Future[FilledMasks]
    dead_ends: dict[int, str] = field(default_factory=dict)  # seq_id -> why it stops (after apply)
    offsets: list[int] = field(default_factory=list)  # empty: every row's offset is 0
    dead_offsets: dict[int, int] = field(default_factory=dict)  # seq_id -> its first dead end's row offset


class StructuredOutputs:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_token_ids: list[int],
        disable_any_whitespace: bool = False,
        cache_size: int = 512,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.stop_token_ids = stop_token_ids
        self.disable_any_whitespace = disable_any_whitespace
        self.cache_size = cache_size
        self._backend: Any = None
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None
        self._compiles: Any = None  # the server's GrammarCompilePool, made on first use

    @property
    def backend(self) -> Any:
        """The xgrammar backend, built on first use (imports xgrammar and scans the vocabulary)."""
        with self._lock:
            if self._backend is None:
                if self.tokenizer is None:
                    raise ValueError(
                        "structured outputs need a tokenizer; this engine has none (skip_tokenizer_init)."
                    )
                from loraserve.structured_output.xgrammar_backend import XGrammarBackend

                self._backend = XGrammarBackend(
                    self.tokenizer, self.vocab_size, self.stop_token_ids, self.cache_size
                )
            return self._backend

    def key(self, params: StructuredOutputsParams) -> GrammarKey:
        """The cache key of a request's constraint, checked against the compile budget (a ValueError
        naming the request's field when over it)."""
        key = params.grammar_key()
        if self.disable_any_whitespace and key.any_whitespace:
            key = GrammarKey(key.kind, key.text, any_whitespace=False)
        check_budget(key, params.param)
        return key

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The compiled grammar of a request's constraint, compiled on this thread when not cached (the
        offline engine's path; the server compiles on `compile_pool`); GrammarCompileError (a
        ValueError) if it does not compile, with vLLM's text."""
        try:
            return self.backend.compile(self.key(params))
        except (GrammarCompileError, JSONDepthError) as exc:
            exc.parameter = exc.parameter or params.param
            raise

    def cached(self, key: GrammarKey) -> Any:
        """`key`'s compiled grammar if it is cached, else None; never waits (no backend yet: None)."""
        backend = self._backend
        return None if backend is None else backend.cache.get(key)

    def compile_pool(self, settings: Any) -> Any:
        """The pool of compile worker processes (`compile_pool.GrammarCompilePool`, made on first use
        with `settings`); its grammars land in this engine's cache."""
        if self._compiles is not None:  # no lock: the backend's first build holds it for a second
            return self._compiles
        with self._lock:
            if self._compiles is None:
                from loraserve.structured_output.compile_pool import GrammarCompilePool

                self._compiles = GrammarCompilePool(
                    lambda: self.backend.tokenizer_info_json(),
                    lambda key, serialized: self.backend.load(key, serialized),
                    settings,
                )
            return self._compiles

    def compile_stats(self) -> dict[str, int]:
        """The compile pool's counters (all zero before its first compile: the series exist from the start)."""
        pool = self._compiles
        if pool is None:
            from loraserve.structured_output.compile_pool import GrammarCompilePool

            return GrammarCompilePool.empty_stats()
        return pool.stats()

    def new_state(self, compiled: Any) -> GrammarState:
        return GrammarState(self.backend.matcher(compiled))

    def start_step(self, scheduled: Sequence[ScheduledItem]) -> MaskJob | None:
        """Start filling the masks of the constrained sequences that sample this step; None if none."""
        items = [
            item
            for item in scheduled
            if item.seq.grammar is not None
            and item.seq.num_computed_tokens + item.num_new_tokens == item.seq.num_tokens
        ]
        if not items:
            return None
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="loraserve-grammar")
        seqs = [item.seq for item in items]
        proposed = [list(getattr(item, "draft_tokens", ())) for item in items]
        if not any(proposed):
            return MaskJob([seq.seq_id for seq in seqs], self._pool.submit(_fill, seqs, self.vocab_size))
        seq_ids = [seq.seq_id for seq, draft in zip(seqs, proposed) for _ in range(len(draft) + 1)]
        offsets = [i for draft in proposed for i in range(len(draft) + 1)]
        return MaskJob(seq_ids, self._pool.submit(_fill, seqs, self.vocab_size, proposed), offsets=offsets)

    @torch.inference_mode()  # the runner's logits are inference tensors
    def apply(
        self,
        job: MaskJob | None,
        logits: torch.Tensor,
        sample_seqs: Sequence[ConstrainedSeq],
        offsets: Sequence[int] | None = None,
    ) -> None:
        """Wait for the masks and apply them to the rows of `logits` (one per `sample_seqs`, at row
        `offsets[i]` of its sequence: None, all 0); a dead end's row allows only its stop token and
        the sequence is recorded in `job.dead_ends` (and its row offset in `job.dead_offsets`)."""
        if job is None:
            return
        filled = job.future.result()
        where = {key: j for j, key in enumerate(zip(job.seq_ids, job.offsets or [0] * len(job.seq_ids)))}
        rows: list[int] = []
        sources: list[int] = []
        dead_rows: list[int] = []
        for i, seq in enumerate(sample_seqs):
            offset = offsets[i] if offsets else 0
            j = where.get((seq.seq_id, offset))
            if j is None:
                continue
            reason = filled.reasons[j]
            if reason is not None:
                if offset < job.dead_offsets.get(seq.seq_id, offset + 1):  # its first dead end
                    job.dead_ends[seq.seq_id] = reason
                    job.dead_offsets[seq.seq_id] = offset
                dead_rows.append(i)
                if offset == 0:  # (a proposal's row is a dead end only if the step gets there)
                    logger.info("Structured output of sequence %d stops: %s", seq.seq_id, reason)
                continue
            rows.append(i)
            sources.append(j)
        if rows:
            same = sources == list(range(len(job.seq_ids)))
            mask_rows(logits, filled.disallowed if same else filled.disallowed[sources], rows)
        if dead_rows:
            stop = self.stop_token_ids[0] if self.stop_token_ids else 0
            index = torch.tensor(dead_rows, dtype=torch.long, device=logits.device)
            logits[index] = float("-inf")
            logits[index, stop] = 0.0

    def wait(self, job: MaskJob | None) -> None:
        """Let a job finish (a step that ended before sampling): no worker touches a grammar later."""
        if job is not None:
            job.future.exception()

    def stop_compiles(self) -> None:
        """Kill the compile workers (a shutdown waits for no compile); waiting requests fail (503)."""
        if self._compiles is not None:
            self._compiles.shutdown()

    def shutdown(self) -> None:
        self.stop_compiles()
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None


def _fill(
    seqs: list[ConstrainedSeq], vocab_size: int, proposed: list[list[int]] | None = None
) -> FilledMasks:
    """Worker thread: advance each grammar to its sequence's tokens, fill its bitmask row (and one row
    after each of its `proposed` tokens), and unpack the rows into the tokens each may not take."""
    import xgrammar as xgr

    drafts = proposed or [[] for _ in seqs]
    bitmask = xgr.allocate_token_bitmask(sum(len(draft) + 1 for draft in drafts), vocab_size)
    reasons: list[str | None] = []
    for seq, draft in zip(seqs, drafts, strict=True):
        state = seq.grammar
        assert state is not None
        row = len(reasons)
        try:
            state.advance(seq.output_token_ids)
            reasons.append(None if state.fill(bitmask, row) else state.dead_end)
            if draft:
                reasons.extend(state.fill_ahead(bitmask, row + 1, draft))
        except Exception as exc:  # this grammar's fault ends this sequence only, never the batch
            reasons[row:] = [f"the grammar failed: {type(exc).__name__}: {exc}"] * (len(draft) + 1)
    disallowed = disallowed_tokens(bitmask, vocab_size)
    for row, blocked in enumerate(disallowed.all(dim=1).tolist()):
        if blocked and reasons[row] is None:
            reasons[row] = "the grammar allows no token here"
    return FilledMasks(disallowed, reasons)
