"""The `serve` flags of scale-out: `--replicas N` engines behind one HTTP front end (on Ray Serve), and
how requests are spread over them. Ray-free: only the launcher of the replicas imports Ray."""

from __future__ import annotations

import argparse
from typing import Any

from loraserve.entrypoints.openai.cli_types import positive_int

# The same number as affinity.DEFAULT_SPREAD_QUEUE_DEPTH, repeated so that parsing flags never imports
# the Ray package (a test checks they agree).
DEFAULT_SPREAD_QUEUE_DEPTH = 8


def positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from exc
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
    return number


def add_replica_args(group: Any) -> None:
    group.add_argument(
        "--replicas",
        type=positive_int,
        default=1,
        help="Engine replicas behind this one HTTP server, run by Ray Serve (pip install 'loraserve[ray]'); "
        "each gets every engine flag. A local Ray starts unless RAY_ADDRESS names a cluster to join "
        "(default: 1, one engine in this process, no Ray).",
    )
    group.add_argument(
        "--replica-spread-queue-depth",
        type=positive_int,
        default=DEFAULT_SPREAD_QUEUE_DEPTH,
        help="An adapter's requests go to the replica that holds it until that many of them are in flight "
        "there; the next one goes to the least loaded other replica too (default: %(default)s).",
    )
    group.add_argument(
        "--replica-cpus",
        type=positive_float,
        default=None,
        help="CPUs Ray reserves for each replica (default: this machine's cores / --replicas with a local "
        "Ray, 1 in a cluster).",
    )
    group.add_argument(
        "--replica-gpus",
        type=positive_float,
        default=None,
        help="GPUs Ray reserves for each replica (default: 1 with --device cuda, else 0).",
    )
