"""`ModelRunner.run`: one step's model work, from the scheduled sequences to one sampled token per row.

It activates the batch's adapters, turns the step into tensors (flat input ids and positions, the
attention indices, the token -> LoRA-slot mapping: `loraserve.batch`), runs the model once over the
paged KV cache it owns (allocated once), and samples the rows whose context is complete. Sequences are
ordered by adapter so each adapter's tokens are contiguous for the multi-LoRA ops. A sequence with
proposed tokens (speculative decoding, `ScheduledSeq.draft`) runs them after its own token in the same
forward and samples a row at each of them, every row with the history (penalties, min_tokens, bad
words) and noise it would have had without speculation (`spec_verify.py` keeps the agreeing prefix).
It reads sequences and never writes them: the scheduler applies the step (`Scheduler.update`).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from loraserve.batch.attention_metadata import build_attention_metadata
from loraserve.batch.forward_batch import ForwardBatch
from loraserve.batch.kv_cache import KVCache
from loraserve.batch.kv_cache_spec import KVCacheSpec
from loraserve.batch.lora_mapping import LoRABatchMapping
from loraserve.engine.beam_group import beam_candidates
from loraserve.engine.image_inputs import step_inputs
from loraserve.engine.kv_budget import allocate_kv_caches
from loraserve.engine.sampler import Sampler, SamplerOutput, SamplingRow
from loraserve.engine.sequence import BeamCandidates, DraftRound, Request, Sequence
from loraserve.engine.step_types import ScheduledSeq, verification_rows

if TYPE_CHECKING:
    from loraserve.lora.manager import LoRAManager

logger = logging.getLogger(__name__)

# What a step's LoRA mapping is built from: the token slots and the token scales (None: all 1).
_MappingKey = tuple[tuple[int, ...], tuple[float, ...] | None]


@dataclass(slots=True)
class PromptLogprobChunk:
    """Logits for prompt positions [start, start + rows) of `seq`, predicting tokens start+1..."""

    seq: Sequence
    start: int
    logits: torch.Tensor


@dataclass(slots=True)
class StepResult:
    # One per logits row: the sequences whose whole context is now computed (a speculating one has a
    # row at its own token and one at each proposed token, consecutive).
    sample_seqs: list[Sequence]
    logits: torch.Tensor  # [len(sample_seqs), vocab], float32 or the LM head's dtype (the sampler converts)
    prompt_chunks: list[PromptLogprobChunk]
    row_offsets: list[int] = field(default_factory=list)  # per row: proposed tokens before it (0: none)
    drafts: dict[int, DraftRound] = field(default_factory=dict)  # seq_id -> its proposals this step


# (logits [rows, vocab], the rows' sequences, their row offsets) -> None, editing the logits in place.
LogitsProcessor = Callable[[torch.Tensor, list[Sequence], list[int]], None]


def _no_tokens() -> SamplerOutput:
    return SamplerOutput([], [], [])


@dataclass(slots=True)
class StepRun:
    """What `ModelRunner.run` did with one scheduled batch.

    `scheduled` is what ran (or, with `error`, what the failure takes down): the batch less the
    sequences whose adapter could not be activated, which `failed` lists (lora_id -> why) so that their
    requests end with their own error, even when the step then raised."""

    scheduled: list[ScheduledSeq]
    failed: dict[int, Exception] = field(default_factory=dict)
    result: StepResult | None = None  # None when nothing ran (every sequence's adapter failed)
    sampled: SamplerOutput = field(default_factory=_no_tokens)  # one token per result.sample_seqs
    beams: list[BeamCandidates] = field(default_factory=list)  # the beam rows' top next tokens
    error: Exception | None = None
    # Requests whose own rows could not be sampled (the others' were): they fail alone.
    request_errors: dict[Request, Exception] = field(default_factory=dict)


class ModelRunner:
    def __init__(
        self,
        model: Any,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_loras: int | None = None,
        lora: LoRAManager | None = None,
        eos_token_id: int | None = None,
        kv_dtype: torch.dtype | None = None,
        image_cache_bytes: int = 256 << 20,
    ) -> None:
        """`dtype` is the model's; `kv_dtype` the KV cache's elements (None: the model's)."""
        self.model = model
        self.max_loras = max_loras
        self.lora = lora
        self.eos_token_id = eos_token_id  # what min_tokens masks
        self.block_size = block_size
        self.device = device
        self.sampler = Sampler()
        self.images = step_inputs(model, image_cache_bytes, lora, max_loras, device)  # None: text only
        self.spec: KVCacheSpec = self.model.kv_cache_spec()
        # The last step's LoRA mapping and the token slots it was built from: decode steps of an
        # unchanged batch reuse it (it is immutable, and its index tensors are only read).
        self._lora_mapping: tuple[_MappingKey, LoRABatchMapping] | None = None
        self._rows_lora_mapping: tuple[_MappingKey, LoRABatchMapping] | None = None  # of the logits rows
        self.kv_caches: list[KVCache] = allocate_kv_caches(
            self.spec, num_blocks, block_size, kv_dtype or dtype, device
        )

    def run(
        self,
        scheduled: list[ScheduledSeq],
        process_logits: LogitsProcessor | None = None,
        block_copies: list[tuple[int, int]] | None = None,
    ) -> StepRun:
        """Copy the KV blocks the scheduler asks for (beams' copy on write), activate the adapters, run
        the model and sample; beam rows also get their top candidates. Never raises: what raised comes
        back as `error`, with the sequences it takes down, so the caller fails exactly those requests.
        `process_logits(logits, sample_seqs)` edits the sample rows' logits in place before sampling
        (the grammar masks of structured outputs)."""
        step = StepRun(scheduled)
        try:
            if block_copies:
                self.copy_blocks(block_copies)
            lora_slots = None
            if self.lora is not None:
                lora_slots, step.failed = self.lora.prepare_step(
                    {s.seq.lora_id for s in scheduled if s.seq.lora_id}
                )
                if step.failed:
                    step.scheduled = [s for s in scheduled if s.seq.lora_id not in step.failed]
            if step.scheduled:
                step.result = self.execute(step.scheduled, lora_slots)
                step.sampled = self.sample(step.result, process_logits, step.request_errors)
                seqs = step.result.sample_seqs
                if step.request_errors:  # a failed request's rows have no candidates
                    seqs = [seq for seq in seqs if seq.request not in step.request_errors]
                    index = [
                        i
                        for i, seq in enumerate(step.result.sample_seqs)
                        if seq.request not in step.request_errors
                    ]
                    step.beams = beam_candidates(step.result.logits[index], seqs)
                else:
                    step.beams = beam_candidates(step.result.logits, seqs)
        except Exception as exc:
            step.error = exc
        finally:
            if self.lora is not None:
                self.lora.end_step()  # also after a failed step: no adapter stays marked in use
        return step

    @torch.inference_mode()
    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """KV block `src` -> `dst` (rows and scales) in every layer, in order (a later copy may read an
        earlier one's block)."""
        for src, dst in copies:
            for cache in self.kv_caches:
                cache.copy_block(src, dst, self.block_size)

    @torch.inference_mode()
    def execute(self, scheduled: list[ScheduledSeq], lora_slots: dict[int, int] | None) -> StepResult:
        """Run one forward pass. `lora_slots` maps lora_id -> compute slot (None: LoRA off)."""
        if lora_slots is not None:
            # Base tokens first, then one contiguous segment per slot in slot order: a balanced
            # multi-adapter decode batch becomes a [slots, tokens] grid the LoRA ops use as a view.
            scheduled = sorted(scheduled, key=lambda s: lora_slots.get(s.seq.lora_id, -1))
        input_ids: list[int] = []
        positions: list[int] = []
        token_slots: list[int] = []
        token_scales: list[float] = []
        scaled = lora_slots is not None and any(s.seq.lora_scale != 1.0 for s in scheduled)
        query_lens: list[int] = []
        context_lens: list[int] = []
        block_tables: list[list[int]] = []
        seq_lens: list[int] = []
        for item in scheduled:
            seq, start, draft = item.seq, item.seq.num_computed_tokens, item.draft_tokens
            end = start + item.num_new_tokens
            num_query = item.num_new_tokens + len(draft)
            input_ids.extend(seq.token_ids[start:end])
            input_ids.extend(draft)
            positions.extend(range(start, end + len(draft)))
            if draft:  # each row attends as its own one-token query (see `verification_rows`)
                verification_rows(
                    end, len(draft), seq.block_ids, query_lens, context_lens, block_tables, seq_lens
                )
            else:
                query_lens.append(num_query)
                context_lens.append(end)
                block_tables.append(seq.block_ids)
                seq_lens.append(seq.num_tokens)
            if lora_slots is not None:
                slot = lora_slots[seq.lora_id] if seq.lora_id else -1
                token_slots.extend([slot] * num_query)
                if scaled:
                    token_scales.extend([seq.lora_scale] * num_query)

        scales = token_scales if scaled else None
        attn = build_attention_metadata(
            query_lens, context_lens, block_tables, self.block_size, self.device, self.spec.sliding_window
        )
        overlay = None if self.images is None else self.images.apply(scheduled, lora_slots, input_ids, attn)
        hidden = self.model(
            torch.tensor(input_ids, dtype=torch.long, device=self.device),
            self.images.positions(scheduled)
            if self.images is not None and self.images.mrope
            else torch.tensor(positions, dtype=torch.long, device=self.device),
            self.kv_caches,
            ForwardBatch(
                attn=attn,
                lora=None if lora_slots is None else self._mapping(token_slots, scales),
                seq_lens=seq_lens,
                embeds=overlay,
            ),
        )
        return self._select_logits(scheduled, hidden, lora_slots)

    def _mapping(self, token_slots: list[int], token_scales: list[float] | None) -> LoRABatchMapping:
        key = (tuple(token_slots), None if token_scales is None else tuple(token_scales))
        if self._lora_mapping is None or self._lora_mapping[0] != key:
            self._lora_mapping = (
                key,
                LoRABatchMapping.build(
                    token_slots, self.device, max_loras=self.max_loras, token_scales=token_scales
                ),
            )
        return self._lora_mapping[1]

    def sample(
        self,
        result: StepResult,
        process_logits: LogitsProcessor | None = None,
        errors: dict[Request, Exception] | None = None,
    ) -> SamplerOutput:
        """One token for each row of `result.sample_seqs` (none when only prefill chunks ran). If
        sampling the batch raises and `errors` is given, each request's rows are sampled again on their
        own: a request that still raises goes into `errors` (its rows get no token), and the others get
        their tokens (greedy and seeded rows exactly those the batch would have given them: seeded
        generators are rewound first; a speculating row's noise was drawn ahead)."""
        if not result.sample_seqs:
            return _no_tokens()
        offsets = result.row_offsets or [0] * len(result.sample_seqs)
        if process_logits is not None:
            process_logits(result.logits, result.sample_seqs, offsets)
        rows = [
            self._sampling_row(seq, offset, result.drafts.get(seq.seq_id))
            for seq, offset in zip(result.sample_seqs, offsets, strict=True)
        ]
        if errors is None:
            return self.sampler(result.logits, rows)
        requests = list(dict.fromkeys(seq.request for seq in result.sample_seqs))
        states = [(row.generator, row.generator.get_state()) for row in rows if row.generator is not None]
        try:
            return self.sampler(result.logits, rows)
        except Exception as exc:
            if len(requests) == 1:
                errors[requests[0]] = exc
                return SamplerOutput([0] * len(rows), [None] * len(rows), [None] * len(rows))
            logger.warning(
                "Sampling a batch of %d requests failed (%s); sampling each alone.", len(requests), exc
            )
        for generator, state in states:
            generator.set_state(state)
        return self._sample_each(result, rows, requests, errors)

    def _sample_each(
        self,
        result: StepResult,
        rows: list[SamplingRow],
        requests: list[Request],
        errors: dict[Request, Exception],
    ) -> SamplerOutput:
        """Each request's rows sampled alone; one that raises goes into `errors` (token 0, no logprobs)."""
        num_rows = len(rows)
        out = SamplerOutput([0] * num_rows, [None] * num_rows, [None] * num_rows)
        for request in requests:
            index = [i for i, seq in enumerate(result.sample_seqs) if seq.request is request]
            try:
                own = self.sampler(result.logits[index], [rows[i] for i in index])
            except Exception as exc:
                errors[request] = exc
                continue
            for j, i in enumerate(index):
                out.token_ids[i], out.logprobs[i] = own.token_ids[j], own.logprobs[j]
                out.top_logprobs[i] = own.top_logprobs[j]
        return out

    def _sampling_row(self, seq: Sequence, offset: int = 0, draft: DraftRound | None = None) -> SamplingRow:
        """Token history is copied only for rows whose penalties or min_tokens read it (bad words:
        only the latest tokens they compare): the copies grow with the context, and most requests
        use none of them. Row `offset` of a speculating sequence has the first `offset` proposed
        tokens in its history, as if they had been sampled, and its pre-drawn noise."""
        params = seq.params
        ahead = draft.tokens[:offset] if draft is not None else []
        prompt_ids = seq.token_ids[: seq.num_prompt_tokens] if params.repetition_penalty != 1.0 else []
        output_ids: list[int] = []
        if params.has_penalties or params.min_tokens > 0:
            output_ids = seq.output_token_ids + ahead
        elif params.bad_words_prefix_len > 0:
            start = max(seq.num_prompt_tokens, len(seq.token_ids) - params.bad_words_prefix_len)
            output_ids = (seq.token_ids[start:] + ahead)[-params.bad_words_prefix_len :]
        noise = draft.noise[offset] if draft is not None and draft.noise is not None else None
        return SamplingRow(params, prompt_ids, output_ids, seq.generator, self.eos_token_id, noise)

    def _rows_mapping(
        self, seqs: list[Sequence], counts: list[int], lora_slots: dict[int, int] | None
    ) -> LoRABatchMapping | None:
        """The LoRA mapping of logits rows (`counts[k]` rows of `seqs[k]`) for a head that carries
        adapter terms (`HeadWithLoRA.lora_active`); None otherwise (the head then runs as the base)."""
        if lora_slots is None or not getattr(self.model.lm_head, "lora_active", False):
            return None
        slots = [
            lora_slots[s.lora_id] if s.lora_id else -1
            for s, n in zip(seqs, counts, strict=True)
            for _ in range(n)
        ]
        scales = [s.lora_scale for s, n in zip(seqs, counts, strict=True) for _ in range(n)]
        scaled = any(c != 1.0 for c, slot in zip(scales, slots, strict=True) if slot >= 0)
        key = (tuple(slots), tuple(scales) if scaled else None)
        if self._rows_lora_mapping is None or self._rows_lora_mapping[0] != key:  # decode steps repeat it
            mapping = LoRABatchMapping.build(
                slots, self.device, max_loras=self.max_loras, token_scales=scales if scaled else None
            )
            self._rows_lora_mapping = (key, mapping)
        return self._rows_lora_mapping[1]

    def _logits(
        self,
        rows: torch.Tensor,
        seqs: list[Sequence],
        counts: list[int],
        lora_slots: dict[int, int] | None,
        float32: bool,
    ) -> torch.Tensor:
        mapping = self._rows_mapping(seqs, counts, lora_slots)
        if mapping is None:
            return self.model.compute_logits(rows, float32=float32)
        return self.model.compute_logits(rows, float32=float32, lora=mapping)

    def _select_logits(
        self, scheduled: list[ScheduledSeq], hidden: torch.Tensor, lora_slots: dict[int, int] | None = None
    ) -> StepResult:
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        row_offsets: list[int] = []
        drafts: dict[int, DraftRound] = {}
        prompt_spans: list[tuple[Sequence, int, int, int]] = []  # seq, first row, num rows, start position
        offset = 0
        for item in scheduled:
            seq, start, n = item.seq, item.seq.num_computed_tokens, item.num_new_tokens
            if seq.params.prompt_logprobs is not None and start < seq.num_prompt_tokens - 1:
                rows = min(n, seq.num_prompt_tokens - 1 - start)
                prompt_spans.append((seq, offset, rows, start))
            num_draft = len(item.draft_tokens)
            if start + n == seq.num_tokens:  # its own token's row, then one per proposed token
                sample_rows.extend(range(offset + n - 1, offset + n + num_draft))
                sample_seqs.extend([seq] * (num_draft + 1))
                row_offsets.extend(range(num_draft + 1))
                if item.draft is not None:
                    drafts[seq.seq_id] = item.draft
            offset += n + num_draft
        logits = (
            self._logits(hidden[sample_rows], sample_seqs, [1] * len(sample_seqs), lora_slots, float32=False)
            if sample_rows
            else hidden.new_empty(0, 0)
        )
        chunks = [
            PromptLogprobChunk(
                seq, start, self._logits(hidden[first : first + rows], [seq], [rows], lora_slots, True)
            )
            for seq, first, rows, start in prompt_spans
        ]
        return StepResult(sample_seqs, logits, chunks, row_offsets, drafts)
