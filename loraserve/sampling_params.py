"""Per-request sampling parameters: vLLM-compatible field names, defaults and validation messages."""

from __future__ import annotations

import copy
import enum
import math
from dataclasses import dataclass, field
from typing import Any

from loraserve.sampling_tokens import (
    BadWordsTable,
    SamplingParamsError,
    bad_words_table,
    check_bad_words,
    check_bad_words_token_ids,
    check_token_ids,
    normalize_allowed_token_ids,
    normalize_logit_bias,
    tokenize_bad_words,
)
from loraserve.structured_output.params import StructuredOutputsParams

# Temperatures below this are treated as greedy (argmax) decoding, as vLLM does.
SAMPLING_EPS = 1e-5
# vLLM's default max_logprobs: the most top-logprobs a request may ask for unless the engine allows more.
MAX_LOGPROBS = 20
# Most parallel completions one request may ask for.
MAX_N = 128


class SamplingType(enum.IntEnum):
    GREEDY = 0
    RANDOM = 1
    RANDOM_SEED = 2


@dataclass(slots=True)
class SamplingParams:
    """How to pick tokens for one request; `max_tokens=None` is filled by the engine from max_model_len."""

    n: int = 1
    best_of: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0 disables top-k
    min_p: float = 0.0
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    max_tokens: int | None = 16
    min_tokens: int = 0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    detokenize: bool = True
    # A constraint the output must match (JSON schema, regex, choice, grammar, structural tag); a
    # dict of StructuredOutputsParams' fields is accepted too.
    structured_outputs: StructuredOutputsParams | None = None
    # vLLM's token controls (sampling_tokens.py): a bias added to chosen tokens' logits (token id ->
    # bias), the only tokens that may be sampled, and words the output may never contain. bad_words
    # are tokenized by the engine (or the serving layer) into bad_words_token_ids, which may also be
    # given directly (token-id sequences, no tokenizer needed).
    logit_bias: dict[int, float] | None = None
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    bad_words_token_ids: list[list[int]] | None = None
    _bad_words_table: BadWordsTable | None = field(default=None, init=False, repr=False, compare=False)
    # The sampler's tensors of these ids, built on first use (engine/token_controls.py).
    sampler_cache: Any = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if isinstance(self.structured_outputs, dict):
            so: Any = self.structured_outputs
            self.structured_outputs = StructuredOutputsParams.from_dict(so)
        if self.seed == -1:  # the OpenAI-style "no seed" sentinel vLLM also accepts
            self.seed = None
        if self.best_of is None:
            self.best_of = self.n
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        elif self.stop is None:
            self.stop = []
        else:
            self.stop = list(self.stop)
        self.stop_token_ids = [] if self.stop_token_ids is None else list(self.stop_token_ids)
        self._verify_counts()
        self._verify_sampling()
        self._verify_lengths()
        self._verify_stops()
        self._verify_token_controls()
        if self.temperature < SAMPLING_EPS:
            # Greedy decoding ignores these; resetting them keeps the sampler's fast paths simple.
            self.top_p = 1.0
            self.top_k = -1
            self.min_p = 0.0

    def _verify_counts(self) -> None:
        if not isinstance(self.n, int):
            raise ValueError(f"n must be an integer, got {self.n!r}.")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}.")
        if self.n > MAX_N:
            raise ValueError(f"n is too large: n must be at most {MAX_N}, got {self.n}.")
        assert self.best_of is not None
        if self.best_of < self.n:
            raise ValueError(
                f"best_of must be greater than or equal to n, got n={self.n} and best_of={self.best_of}."
            )
        if self.best_of > MAX_N:
            raise ValueError(f"best_of is too large: best_of must be at most {MAX_N}, got {self.best_of}.")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is None:
                continue
            # The upper bound is the engine's max_logprobs (LLMEngine checks it, as vLLM's engine does).
            if value < 0:
                raise ValueError(f"{name} must be non-negative, got {value}.")

    def _verify_sampling(self) -> None:
        if not -2.0 <= self.presence_penalty <= 2.0:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}.")
        if not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}.")
        if not (math.isfinite(self.repetition_penalty) and self.repetition_penalty > 0.0):
            raise ValueError(
                f"repetition_penalty must be a finite number greater than zero, got {self.repetition_penalty}."
            )
        if not (math.isfinite(self.temperature) and self.temperature >= 0.0):
            raise ValueError(f"temperature must be a finite non-negative number, got {self.temperature}.")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}.")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 or 0 (disable), or at least 1, got {self.top_k}.")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}.")

    def _verify_lengths(self) -> None:
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}.")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be greater than or equal to 0, got {self.min_tokens}.")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be less than or equal to max_tokens={self.max_tokens}, got {self.min_tokens}."
            )

    def _verify_stops(self) -> None:
        assert isinstance(self.stop, list) and self.stop_token_ids is not None
        for stop_str in self.stop:
            if not isinstance(stop_str, str):
                raise ValueError(f"stop must be a string or a list of strings, got {stop_str!r}.")
            if not stop_str:
                raise ValueError(f"stop cannot contain an empty string, got stop={self.stop!r}.")
        for token_id in self.stop_token_ids:
            if not isinstance(token_id, int) or token_id < 0:
                raise ValueError(
                    f"stop_token_ids must contain only non-negative integers, got {self.stop_token_ids!r}."
                )
        if self.stop and not self.detokenize:
            raise ValueError(
                "stop strings are only supported when detokenize is True. Set detokenize=True to use stop."
            )

    def _verify_token_controls(self) -> None:
        self.logit_bias = normalize_logit_bias(self.logit_bias)
        self.allowed_token_ids = normalize_allowed_token_ids(self.allowed_token_ids)
        self.bad_words = check_bad_words(self.bad_words)
        if self.bad_words_token_ids is not None:
            self.bad_words_token_ids = check_bad_words_token_ids(self.bad_words_token_ids)
            self._bad_words_table = bad_words_table(self.bad_words_token_ids)

    def update_from_tokenizer(self, tokenizer: Any) -> None:
        """Tokenize `bad_words` as vLLM does (each word, and after a space); a no-op once tokenized."""
        if self.bad_words and self.bad_words_token_ids is None:
            self.bad_words_token_ids = tokenize_bad_words(self.bad_words, tokenizer)
            self._bad_words_table = bad_words_table(self.bad_words_token_ids)

    def verify_token_ids(self, vocab_size: int, tokenizer_size: int | None = None) -> None:
        """vLLM's checks, with its texts, of the token ids this request names against the model's
        vocabulary (allowed_token_ids also against the tokenizer's): SamplingParamsError."""
        check_token_ids(
            self.logit_bias, self.allowed_token_ids, self.bad_words_token_ids, vocab_size, tokenizer_size
        )
        if self.bad_words and self.bad_words_token_ids is None:
            raise SamplingParamsError(
                "bad_words need a tokenizer, and this engine was started with skip_tokenizer_init; use "
                "bad_words_token_ids, allowed_token_ids or logit_bias.",
                "bad_words",
            )

    @property
    def has_token_controls(self) -> bool:
        """Whether the sampler edits this request's logits for logit_bias, allowed_token_ids or bad words."""
        return (
            bool(self.logit_bias) or self.allowed_token_ids is not None or self._bad_words_table is not None
        )

    @property
    def bad_words_table(self) -> BadWordsTable | None:
        """The banned last tokens by the output suffix that precedes them (None without bad words)."""
        return self._bad_words_table

    @property
    def bad_words_prefix_len(self) -> int:
        """How many of the latest output tokens the bad words' check reads."""
        return max(self._bad_words_table) if self._bad_words_table else 0

    @property
    def sampling_type(self) -> SamplingType:
        if self.temperature < SAMPLING_EPS:
            return SamplingType.GREEDY
        if self.seed is not None:
            return SamplingType.RANDOM_SEED
        return SamplingType.RANDOM

    @property
    def is_greedy(self) -> bool:
        return self.temperature < SAMPLING_EPS

    @property
    def has_penalties(self) -> bool:
        """Whether the sampler must read this request's token history to penalise repeats."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def output_text_buffer_length(self) -> int:
        """Characters a streamed response must hold back because they may start a stop string."""
        if not self.stop or self.include_stop_str_in_output:
            return 0
        return max(len(s) for s in self.stop) - 1

    def clone(self) -> SamplingParams:
        """A deep copy, so that the engine may fill fields (max_tokens, seed per child) independently."""
        return copy.deepcopy(self)
