"""Value parsers of options given as text (the `serve` flags): integers with size suffixes as vLLM
reads them, numbers, seconds and JSON objects. Each raises argparse.ArgumentTypeError with what is wrong."""

from __future__ import annotations

import argparse
import json
import re
from typing import Any

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(i?b?)\s*$", re.IGNORECASE)


def positive_int(value: str) -> int:
    number = human_int(value)
    if number < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value!r}")
    return number


def human_int(value: str) -> int:
    """An integer with an optional size suffix, as vLLM reads them.

    Lowercase k/m/g/t and kB/MB/GB are decimal ("8k" = 8000); uppercase K/M/G/T and KiB/MiB/GiB are
    binary ("1G" = "1GiB" = 2**30).
    """
    match = _SIZE.match(value)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected an integer such as 4096, 8k or 1GiB, got {value!r}")
    number, unit, rest = match.groups()
    if not unit:
        if "." in number or rest:
            raise argparse.ArgumentTypeError(f"expected an integer, got {value!r}")
        return int(number)
    is_binary = rest.lower().startswith("i") or (unit.isupper() and not rest)
    base = 1024 if is_binary else 1000
    return int(float(number) * base ** ("kmgt".index(unit.lower()) + 1))


def non_negative_seconds(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number of seconds, got {value!r}") from exc
    if not 0 <= seconds < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number of seconds >= 0, got {value!r}")
    return seconds


def positive_seconds(value: str) -> float:
    seconds = non_negative_seconds(value)
    if seconds == 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds, got {value!r}")
    return seconds


def positive_float(value: str) -> float:
    try:
        number = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a number, got {value!r}") from exc
    if not 0 < number < float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {value!r}")
    return number


def json_value(value: str) -> Any:
    try:
        return json.loads(value)
    except json.JSONDecodeError as exc:
        raise argparse.ArgumentTypeError(f"invalid JSON {value!r}: {exc.msg}") from exc


def json_object(value: str) -> dict[str, Any]:
    parsed = json_value(value)
    if not isinstance(parsed, dict):
        raise argparse.ArgumentTypeError(f"expected a JSON object, got {value!r}")
    return parsed


def queue_share(value: str) -> float:
    """A fraction of the queue: 0 < f <= 1."""
    try:
        share = float(value)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected a fraction such as 0.5, got {value!r}") from exc
    if not 0 < share <= 1:
        raise argparse.ArgumentTypeError(f"must be more than 0 and at most 1, got {value!r}")
    return share
