"""Beam search's request parameters and results, with vLLM's names (`BeamSearchParams`,
`BeamSearchSequence`, `BeamSearchOutput`) and transformers' scoring.

The engine runs the search (`engine/beam_group.py`); these are the value types its callers
(`LLM.beam_search`, the OpenAI server's `use_beam_search`) hand in and get back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from loraserve.outputs import PositionLogprobs

# Most beams one request may ask for (as many as parallel samples: sampling_params.MAX_N).
MAX_BEAM_WIDTH = 128


@dataclass(frozen=True, slots=True)
class BeamSearchParams:
    """vLLM's fields, in vLLM's order, plus transformers' `early_stopping` (True, False or "never":
    when the search ends, as `generate(early_stopping=...)`) and `num_return_sequences` (how many of
    the `beam_width` best to return; None: all of them, vLLM's behaviour).

    The beams' next-token scores are the model's log-probabilities (`temperature` is accepted for
    vLLM's signature and, as there, does not change them). Stop strings do not apply; eos, the
    model's extra eos ids and `stop_token_ids` end a beam unless `ignore_eos`."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False
    num_return_sequences: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    skip_special_tokens: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.beam_width, bool) or not isinstance(self.beam_width, int) or self.beam_width < 1:
            raise ValueError(f"beam_width must be a positive integer, got {self.beam_width!r}.")
        if self.beam_width > MAX_BEAM_WIDTH:
            raise ValueError(f"beam_width must be at most {MAX_BEAM_WIDTH}, got {self.beam_width}.")
        if isinstance(self.max_tokens, bool) or not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens!r}.")
        if not math.isfinite(self.length_penalty):
            raise ValueError(f"length_penalty must be a finite number, got {self.length_penalty}.")
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite non-negative number, got {self.temperature}.")
        stopping = self.early_stopping
        if not (stopping is True or stopping is False or stopping == "never"):
            raise ValueError(f'early_stopping must be true, false or "never", got {stopping!r}.')
        n = self.num_return_sequences
        if n is not None and not 1 <= n <= self.beam_width:
            raise ValueError(
                f"num_return_sequences must be between 1 and beam_width={self.beam_width}, got {n}."
            )
        for token_id in self.stop_token_ids:
            if isinstance(token_id, bool) or not isinstance(token_id, int) or token_id < 0:
                raise ValueError(
                    f"stop_token_ids must be non-negative integers, got {self.stop_token_ids!r}."
                )

    @property
    def n(self) -> int:
        """Sequences the request occupies at once (admission control counts it like sampling's n)."""
        return self.beam_width

    @property
    def num_returned(self) -> int:
        return self.num_return_sequences or self.beam_width

    structured_outputs = None  # beam search takes no grammar (the serving layer refuses one)


def beam_score(cum_logprob: float, num_generated: int, length_penalty: float) -> float:
    """transformers' length-penalised score of a finished beam: the sum of its tokens' logprobs over
    (generated tokens, eos included) ** length_penalty. Saturating: a length_penalty so large that
    the power overflows scores 0 (-0.0 for a negative sum), so small that it underflows -inf (0 for a
    zero sum), where the plain division raised OverflowError or ZeroDivisionError inside an engine
    step."""
    try:
        denominator = float(num_generated) ** length_penalty
    except OverflowError:
        denominator = math.inf
    if denominator == 0.0:
        return -math.inf if cum_logprob < 0 else 0.0
    return cum_logprob / denominator


@dataclass(slots=True)
class BeamSearchSequence:
    """One returned beam, as vLLM's: `tokens` are the prompt's then the generated ones, `text` their
    decoded text (prompt included, as vLLM's `LLM.beam_search`)."""

    tokens: list[int]
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    lora_request: object | None = None
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass(slots=True)
class BeamSearchOutput:
    """The best beams of one prompt, best first (`num_returned` of them)."""

    sequences: list[BeamSearchSequence]
