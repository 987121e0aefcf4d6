"""The `serve` flags that bound work and shutdown: admission control (vLLM's queue limits), request
body size and read deadline, and the SIGTERM drain. Parsed here, applied by the engine (queue limits,
EngineArgs fields) and the HTTP layer (the rest, ServerOptions)."""

from __future__ import annotations

from typing import Any

from loraserve.entrypoints.openai.cli_types import (
    non_negative_seconds,
    positive_int,
    positive_seconds,
    queue_share,
)


def add_limit_args(limits: Any) -> None:
    limits.add_argument(
        "--max-num-queued-reqs",
        type=positive_int,
        default=None,
        help="Most sequences waiting or running at once (a request with n choices counts n); beyond it "
        "requests get 503 with Retry-After, and a request larger than it alone gets 400 (default: 1024).",
    )
    limits.add_argument(
        "--max-num-queued-tokens",
        type=positive_int,
        default=None,
        help="Most prompt tokens waiting to be processed, e.g. 256k; beyond it requests get 503 with "
        "Retry-After (default: 262144).",
    )
    limits.add_argument(
        "--max-queued-share",
        type=queue_share,
        default=None,
        help="loraserve only: the fraction (0 < f <= 1) of each queue limit that one request, and all the "
        "requests of one API key together, may hold; a request larger than its share gets 400, so one "
        "client never fills the queue for everyone (default: 0.5).",
    )
    limits.add_argument(
        "--queue-wait-timeout",
        dest="queue_wait_timeout_s",  # the EngineArgs / SchedulerConfig field
        type=non_negative_seconds,
        default=None,
        help="loraserve only: seconds a request that finds the queue full waits for room (in turn, "
        "round-robin by API key) before its 503; 0 answers 503 at once (default: 5).",
    )
    limits.add_argument(
        "--max-request-body-size",
        type=positive_int,
        default=4 << 20,
        help="Largest request body in bytes, e.g. 16MiB; a larger one gets 413 (default: 4MiB: parsing a "
        "body holds the event loop, about 0.3 s per MiB of JSON in the worst case).",
    )
    limits.add_argument(
        "--request-read-timeout",
        type=positive_seconds,
        default=30.0,
        help="Seconds within which a request's head, and then its body, must arrive; a slower "
        "connection is closed (head) or answered 408 (body) (default: %(default)s).",
    )
    limits.add_argument(
        "--shutdown-timeout",
        type=non_negative_seconds,
        default=30.0,
        help="On SIGTERM, seconds running requests may take to finish before they end with 503 "
        "(streams: an error event, then [DONE]); 0 ends them at once (default: %(default)s).",
    )
