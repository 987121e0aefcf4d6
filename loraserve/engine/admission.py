"""Admission control: whether a new request fits the engine's queue now, later, or never.

Two limits, with vLLM's names: `max_num_queued_reqs` bounds the sequences in flight (waiting and
running; a request with n choices counts n times), `max_num_queued_tokens` bounds the prompt tokens
still to prefill (the backlog in front of a new request's first token). A request that exceeds a limit
on its own can never run (RequestTooLargeError, HTTP 400); one that only overflows the current queue
is turned away with EngineOverloadedError (HTTP 503 with Retry-After), so a load balancer can send it
elsewhere instead of letting it wait unboundedly here.
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


def check_request_size(config: SchedulerConfig, num_seqs: int, num_prefill_tokens: int) -> None:
    """RequestTooLargeError when the request alone exceeds a limit (an empty server would refuse it)."""
    if num_seqs > config.max_num_queued_reqs:
        raise RequestTooLargeError(
            f"This request needs {num_seqs} sequences (prompts x n), more than this server queues at once "
            f"({config.max_num_queued_reqs}, --max-num-queued-reqs). Send fewer prompts or a smaller n."
        )
    if num_prefill_tokens > config.max_num_queued_tokens:
        raise RequestTooLargeError(
            f"This request has {num_prefill_tokens} prompt tokens to process (summed over prompts x n), "
            f"more than this server queues at once ({config.max_num_queued_tokens}, --max-num-queued-tokens). "
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
