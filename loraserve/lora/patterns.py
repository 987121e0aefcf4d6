r"""`PatternMatcher`: the regexes of one adapter's config, run under one time budget, with PEFT's rules.

`target_modules` / `exclude_modules` (a string is a PEFT full-match regex), the keys of
`rank_pattern` / `alpha_pattern` and `layers_pattern` are client input, matched against every module
name of the model. Python's `re` has no time bound and holds the GIL while it backtracks: one
catastrophic pattern froze the whole server for 26 s. The `regex` package takes a timeout per call
and, with `concurrent=True`, releases the GIL while it matches. Each adapter gets one budget for all
its compiling and matching; a pattern that exhausts it is refused with a LoRAAdapterError naming the
adapter and the field. Compiling is not interruptible and `regex` unrolls counted repeats, so a
pattern's compiled size is bounded before it is compiled (`pattern_cost.py`: at most
`MAX_PATTERN_NODES` per pattern, `MAX_ADAPTER_NODES` for all of an adapter's patterns together, on
`re`'s parse of it); patterns are also capped in length.

PEFT's rules (read for facts): a string `target_modules` full-matches the module name; a
`rank_pattern` / `alpha_pattern` key matches when `(.*\.)?(key)$` matches from the start, first key in
file order wins; `layers_pattern` names the segment before the layer index.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Mapping
from typing import Any

import regex

from loraserve.errors import LoRAAdapterError
from loraserve.lora.pattern_cost import MAX_PATTERN_NODES, PatternCostError, pattern_nodes

PATTERN_BUDGET_S = 1.0  # real configs match a whole model in milliseconds
MAX_PATTERN_CHARS = 4096
# All of one adapter's patterns together (a rank_pattern of many keys): ~15 MB and ~20 ms to compile.
MAX_ADAPTER_NODES = 5 * MAX_PATTERN_NODES


def key_regex(key: str) -> str:
    """The regex a rank_pattern / alpha_pattern key stands for."""
    return rf"(.*\.)?({key})$"


def layers_regex(layers_pattern: str) -> str:
    """The regex finding the layer index after a layers_pattern segment."""
    return rf"(?:^|.*?\.){layers_pattern}\.(\d+)\."


class PatternMatcher:
    """Compiles (once) and runs the patterns of adapter `lora_name`; thread-safe."""

    def __init__(self, lora_name: str, budget_s: float = PATTERN_BUDGET_S) -> None:
        self.lora_name = lora_name
        self.budget_s = budget_s
        self._remaining = budget_s
        self._nodes_left = MAX_ADAPTER_NODES
        self._compiled: dict[str, regex.Pattern[str]] = {}
        self._lock = threading.Lock()

    def compile(self, pattern: str, field: str) -> regex.Pattern[str]:
        """The compiled pattern; LoRAAdapterError (naming `field`) if it is too long, invalid or the
        budget is spent."""
        with self._lock:
            compiled = self._compiled.get(pattern)
        if compiled is not None:
            return compiled
        if len(pattern) > MAX_PATTERN_CHARS:
            raise self._error(field, f"is longer than {MAX_PATTERN_CHARS} characters")
        self._check_budget(field)
        start = time.perf_counter()
        try:
            self._reserve_nodes(pattern, field)
            compiled = regex.compile(pattern)
        except (regex.error, OverflowError, RecursionError) as e:
            raise self._error(field, f"is an invalid regular expression ({e})") from None
        finally:
            self._spend(time.perf_counter() - start)
        with self._lock:
            self._compiled[pattern] = compiled
        return compiled

    def _reserve_nodes(self, pattern: str, field: str) -> None:
        """Take the pattern's compiled size from the adapter's node budget, or refuse it unread."""
        try:
            nodes = pattern_nodes(pattern)
        except PatternCostError as e:
            raise self._error(field, str(e)) from None
        with self._lock:
            if nodes > self._nodes_left:
                raise self._error(
                    field,
                    f"brings this adapter's patterns past {MAX_ADAPTER_NODES} regex nodes in all; "
                    "use fewer or simpler patterns",
                )
            self._nodes_left -= nodes

    def fullmatch(self, pattern: str, string: str, field: str) -> regex.Match[str] | None:
        return self._run(self.compile(pattern, field).fullmatch, string, field)

    def match(self, pattern: str, string: str, field: str) -> regex.Match[str] | None:
        return self._run(self.compile(pattern, field).match, string, field)

    def first_key(self, patterns: Mapping[str, Any], module_name: str, field: str) -> str | None:
        """The first rank_pattern / alpha_pattern key (file order) that matches `module_name`."""
        for key in patterns:
            if self.match(key_regex(key), module_name, field):
                return key
        return None

    def matches_targets(self, targets: tuple[str, ...] | str, module_name: str, field: str) -> bool:
        """Whether target_modules / exclude_modules name `module_name`: a full-match regex (or
        "all-linear"), else a list of names or name suffixes."""
        if isinstance(targets, str):
            return targets == "all-linear" or self.fullmatch(targets, module_name, field) is not None
        return any(module_name == t or module_name.endswith(f".{t}") for t in targets)

    def layer_index(self, module_name: str, layers_pattern: tuple[str, ...] | None) -> int | None:
        """The layer index in `module_name`: after a layers_pattern segment, else the first numbered
        segment (the layer, not an expert index further down)."""
        if not layers_pattern:
            match = re.match(r".*?\.[^.]*\.(\d+)\.", module_name)  # the server's own pattern
            return int(match.group(1)) if match else None
        for pattern in layers_pattern:
            found = self.match(layers_regex(pattern), module_name, "layers_pattern")
            if found:
                return int(found.group(1))
        return None

    def _run(self, method: object, string: str, field: str) -> regex.Match[str] | None:
        self._check_budget(field)
        start = time.perf_counter()
        try:
            return method(string, timeout=max(self._remaining, 1e-3), concurrent=True)  # type: ignore[operator]
        except TimeoutError:
            self._remaining = 0.0
            raise self._too_slow(field) from None
        finally:
            self._spend(time.perf_counter() - start)

    def _check_budget(self, field: str) -> None:
        if self._remaining <= 0:
            raise self._too_slow(field)

    def _spend(self, seconds: float) -> None:
        with self._lock:
            self._remaining -= seconds

    def _too_slow(self, field: str) -> LoRAAdapterError:
        return self._error(
            field,
            f"took too long to match the model's module names (over {self.budget_s:g} s in all); "
            "use a simpler pattern or a list of module names",
        )

    def _error(self, field: str, problem: str) -> LoRAAdapterError:
        return LoRAAdapterError(
            f"LoRA adapter '{self.lora_name}': the pattern in field '{field}' of adapter_config.json {problem}"
        )
