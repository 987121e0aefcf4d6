"""What the engine returns for a request: cumulative text, token ids, logprobs, finish reason."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """Log probability of one token, its rank in the distribution (1 = most likely) and its text."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per position: token id -> Logprob (the sampled/actual token plus the top-k alternatives).
PositionLogprobs = dict[int, Logprob]


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort" | "error"
    stop_reason: int | str | None = None

    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    lora_name: str | None = None
    error: str | None = None
    # The client-caused exception behind `error` (an adapter that cannot be read again: a
    # LoRAAdapterError, which the server answers with its 4xx); None when the server failed (500).
    error_cause: Exception | None = None
    # arrival_time and, once admitted, first_scheduled_time (time.time() seconds)
    metrics: dict[str, float] = field(default_factory=dict)
    num_cached_tokens: int | None = None  # prompt tokens served from the prefix cache (first admission)
