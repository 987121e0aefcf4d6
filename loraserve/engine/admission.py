"""Admission control: whether a new request fits the engine's queue now, later, or never.

Two limits, with vLLM's names: `max_num_queued_reqs` bounds the sequences in flight (waiting and
running; a request with n choices counts n times), `max_num_queued_tokens` bounds the prompt tokens
still to prefill (the backlog in front of a new request's first token). A request that exceeds a limit
on its own can never run (RequestTooLargeError, HTTP 400); one that only overflows the current queue
is turned away with EngineOverloadedError (HTTP 503 with Retry-After), so a load balancer can send it
elsewhere instead of letting it wait unboundedly here.

Fair shares: one request may hold at most `max_queued_share` of each limit (`share_limits`); a larger
one is refused like one larger than the whole queue (400, naming both flags), so no single request
can fill the queue and turn every other client away. The per-client share and the bounded wait for
room are `fair_admission.py`'s (the server's side, where clients are known).
"""

from __future__ import annotations

from dataclasses import dataclass

from loraserve.config import SchedulerConfig
from loraserve.errors import EngineOverloadedError, RequestTooLargeError

RETRY_AFTER_S = 1


@dataclass(frozen=True, slots=True)
class QueueLoad:
    """What the scheduler holds now."""

    num_seqs: int  # waiting + running
    num_prefill_tokens: int  # prompt tokens not computed yet


@dataclass(frozen=True, slots=True)
class ShareLimits:
    """The most one request (or one client) may hold: `max_queued_share` of each queue limit."""

    num_seqs: int
    num_prefill_tokens: int


def share_limits(config: SchedulerConfig) -> ShareLimits:
    # At least one sequence and one prompt's tokens, so a tiny queue or share still serves something.
    return ShareLimits(
        max(1, int(config.max_num_queued_reqs * config.max_queued_share)),
        max(1, int(config.max_num_queued_tokens * config.max_queued_share)),
    )


def check_request_size(config: SchedulerConfig, num_seqs: int, num_prefill_tokens: int) -> None:
    """RequestTooLargeError when the request alone exceeds its share of a limit (an empty server would
    refuse it)."""
    share = share_limits(config)
    if num_seqs > share.num_seqs:
        raise RequestTooLargeError(
            f"This request needs {num_seqs} sequences (prompts x n), more than one request may queue at once "
            f"({share.num_seqs}: --max-queued-share {config.max_queued_share:g} of --max-num-queued-reqs "
            f"{config.max_num_queued_reqs}). Send fewer prompts or a smaller n."
        )
    if num_prefill_tokens > share.num_prefill_tokens:
        raise RequestTooLargeError(
            f"This request has {num_prefill_tokens} prompt tokens to process (summed over prompts x n), "
            f"more than one request may queue at once ({share.num_prefill_tokens}: --max-queued-share "
            f"{config.max_queued_share:g} of --max-num-queued-tokens {config.max_num_queued_tokens}). "
            "Send fewer or shorter prompts, or a smaller n."
        )


def check_admission(config: SchedulerConfig, load: QueueLoad, num_seqs: int, num_prefill_tokens: int) -> None:
    """Raise unless a request of this size may join the queue now."""
    check_request_size(config, num_seqs, num_prefill_tokens)
    if load.num_seqs + num_seqs > config.max_num_queued_reqs:
        raise EngineOverloadedError(
            f"The server is busy: {load.num_seqs} sequences are queued or running and this request adds "
            f"{num_seqs}, over the limit of {config.max_num_queued_reqs}. Retry later.",
            RETRY_AFTER_S,
        )
    if load.num_prefill_tokens + num_prefill_tokens > config.max_num_queued_tokens:
        raise EngineOverloadedError(
            f"The server is busy: {load.num_prefill_tokens} prompt tokens are waiting to be processed and "
            f"this request adds {num_prefill_tokens}, over the limit of {config.max_num_queued_tokens}. "
            "Retry later.",
            RETRY_AFTER_S,
        )
