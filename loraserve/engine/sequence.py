"""Per-sequence and per-request state.

The scheduler is the only writer of a `Sequence`: it admits, preempts, advances computed tokens,
appends sampled tokens and finishes it. The runner, sampler and output processor only read it.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import torch

from loraserve.outputs import PositionLogprobs

if TYPE_CHECKING:
    from loraserve.beam_search import BeamSearchParams
    from loraserve.engine.detokenizer import IncrementalDetokenizer
    from loraserve.lora.request import LoRARequest
    from loraserve.sampling_params import SamplingParams
    from loraserve.structured_output.grammar_state import GrammarState


class CacheSalt(Protocol):
    """An adapter's content digest, perhaps still being computed (`lora.digest.PendingDigest`)."""

    def done(self) -> bool: ...

    def result(self) -> str: ...


@dataclass(frozen=True, slots=True)
class RequestSalt:
    """A request's own `cache_salt` joined to its adapter's digest (None: the base model's ""), so its
    prefix-cache blocks are shared only with requests that send the same salt (vLLM's cache_salt)."""

    adapter: CacheSalt | None
    salt: str

    def done(self) -> bool:
        return self.adapter is None or self.adapter.done()

    def result(self) -> str:
        return f"{'' if self.adapter is None else self.adapter.result()}|cache_salt:{self.salt}"


@dataclass(frozen=True, slots=True)
class ScaledSalt:
    """An adapter's digest joined to a request's LoRA scale (not 1.0): KV computed at one scale is
    never reused at another, while every request at one scale shares it (the scale is the float's
    repr, so 0.3 and 0.30000001 differ)."""

    adapter: CacheSalt
    scale: float

    def done(self) -> bool:
        return self.adapter.done()

    def result(self) -> str:
        return f"{self.adapter.result()}|lora_scale:{self.scale!r}"


class SequenceStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(slots=True, eq=False)
class Sequence:
    """One generated continuation (a request with n > 1 owns n of them).

    `token_ids` holds prompt then output tokens; `num_computed_tokens` counts those whose KV is in the
    cache. Preemption resets it to 0 and keeps the tokens, so the sequence is recomputed later.
    The detokenizer holds the output text; only the output processor feeds it.
    """

    seq_id: int
    request: Request
    index: int
    token_ids: list[int]
    num_prompt_tokens: int
    generator: torch.Generator | None
    detokenizer: IncrementalDetokenizer | None
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0
    block_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None
    cumulative_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    num_skipped_for_lora: int = 0
    waiting_since_step: int = 0  # the scheduler step at which it last joined the waiting queue
    # Its structured-output grammar (None: unconstrained). The state follows token_ids, which it
    # reads; the mask worker advances it (structured_output/manager.py), nothing else writes it.
    grammar: GrammarState | None = None

    @property
    def params(self) -> SamplingParams:
        return self.request.params

    @property
    def lora_id(self) -> int:
        lora = self.request.lora_request
        return lora.lora_id if lora is not None else 0

    @property
    def lora_scale(self) -> float:
        """The request's scale of its adapter's term (1.0 without one)."""
        lora = self.request.lora_request
        return lora.scale if lora is not None else 1.0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is SequenceStatus.FINISHED

    @property
    def output_text(self) -> str:
        return self.detokenizer.output_text if self.detokenizer is not None else ""


@dataclass(slots=True)
class DraftRound:
    """One sequence's speculation in one step (engine/speculator.py makes it): the proposed tokens the
    step verifies after the sequence's own token, and, for a sampled (not greedy) sequence, the
    Exponential(1) noise each of its len(tokens) + 1 rows samples with, drawn before the draft so that
    a draft model proposes with the very draws the target then samples with. A seeded sequence's
    draws come from its generator, whose state after each draw is kept: the step winds it back to
    just after the draws of the tokens it emitted, so speculation never changes what it samples."""

    tokens: list[int]
    noise: torch.Tensor | None = None  # [len(tokens) + 1, vocab] float32
    states: list[torch.Tensor] | None = None  # seeded: the generator's state after each row's draw


@dataclass(frozen=True, slots=True)
class Hypothesis:
    """A finished beam: its generated tokens (the stop token included), summed logprob and score."""

    token_ids: list[int]
    cum_logprob: float
    score: float
    finish_reason: str
    stop_reason: int | None = None


@dataclass(frozen=True, slots=True)
class BeamCandidates:
    """One beam's best next tokens this round: logprobs (descending) and their token ids."""

    seq: Sequence
    logprobs: list[float]
    token_ids: list[int]


@dataclass(slots=True)
class BeamGroup:
    """A beam search's state (`engine/beam_group.py` runs it; the scheduler is its only writer). Its
    live beams are the request's `seqs`, all of one length; `pending` collects this round's candidates
    until every live beam has them."""

    params: BeamSearchParams
    max_tokens: int  # generated tokens at most (max_tokens, bounded by max_model_len)
    stop_ids: frozenset[int]  # tokens that end a beam (eos, extra eos, stop_token_ids; none with ignore_eos)
    user_stop_ids: frozenset[int] = frozenset()  # the request's own stop_token_ids (its stop_reason)
    pending: dict[int, BeamCandidates] = field(default_factory=dict)  # seq id -> this round's candidates
    finished: list[Hypothesis] = field(default_factory=list)  # best first, at most beam_width
    done: bool = False

    @property
    def width(self) -> int:
        return self.params.beam_width

    @property
    def k(self) -> int:
        """Candidates kept per round (transformers' beams_to_keep): enough that W beams can go on
        even when every beam's best tokens end it."""
        return max(2, 1 + len(self.stop_ids)) * self.width


@dataclass(slots=True, eq=False)
class Request:
    """A user request: one prompt, its sampling parameters, adapter, and n sequences.

    The engine creates it and sets `error`; the output processor records `prompt_logprobs`.
    """

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    lora_request: LoRARequest | None
    arrival_time: float
    cache_salt: CacheSalt | None = None  # adapter identity digest: part of every prefix-cache key
    seqs: list[Sequence] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    error: str | None = None
    error_cause: Exception | None = None  # a client-caused failure (RequestOutput.error_cause)
    group_id: str | None = None  # requests of one API call (its prompts) share it and take turns as one
    num_cached_tokens: int = -1  # prompt tokens found in the prefix cache at first admission (-1: not yet)
    first_scheduled_time: float | None = None  # time.time() of its first admission (queue time's end)
    priority: int = 0  # lower is served first under scheduling_policy "priority" (vLLM's)
    # A beam search's group state (None: sampling). Its live beams are `seqs`; the scheduler owns both.
    beam: BeamGroup | None = None

    @property
    def turn_key(self) -> str:
        """Who this request takes scheduling turns as: its API call's group, else itself."""
        return self.group_id or self.request_id

    @property
    def is_finished(self) -> bool:
        return all(seq.is_finished for seq in self.seqs)

    @property
    def lora_name(self) -> str | None:
        return self.lora_request.lora_name if self.lora_request is not None else None
