r"""What compiling one adapter-config regex may cost, decided before it is compiled.

The `regex` package unrolls counted repeats when it compiles: `(?:(?:(?:a{1000}){1000}){1000})`, 32
characters, becomes a billion nodes (6 GB, 14 s with the GIL held), and compiling cannot be
interrupted. So each pattern is parsed first by the standard library's `re` parser, the one PEFT's
own matching (`re.fullmatch` / `re.match`) runs it through, hence the pattern's meaning, and its size
is bounded on the parse tree: every node counts 1, a repeat `{m,n}` counts its body `n` times (`m + 1`
times when unbounded), the most any unrolling can make of it. A pattern over `MAX_PATTERN_NODES` is
refused unread by `regex`; one under it compiles in milliseconds into a few MB (about 300 bytes per
node, measured). The bound holds for every pattern `re` accepts: the parse is linear in the (capped)
pattern length and the count is computed on the tree, capped as it goes, never by expanding it.
`re`'s own compiler is not run (it walks case-insensitive ranges code point by code point); the one
thing only it refuses, a look-behind of variable width, is checked on the tree.

`regex` reads some spellings differently from `re`, so they are refused rather than guessed at: a
`{` that is not a plain counted repeat (`regex` reads `{e<=1}` as fuzzy matching, `re` as text), and
a `[` or a set operator (`--`, `&&`, `||`, `~~`) inside a character class (`[[:alpha:]]` is a POSIX
class to `regex`, a set plus `]` to `re`). Escaped, they are plain characters to both engines.
"""

from __future__ import annotations

import importlib
import re
from typing import Any

# The parser behind re.compile (re._parser since 3.11, sre_parse before): private, but stable, and
# the only parser whose reading of a pattern is PEFT's.
try:
    _PARSER: Any = importlib.import_module("re._parser")
except ImportError:  # Python 3.10
    _PARSER = importlib.import_module("sre_parse")

MAX_PATTERN_NODES = 10_000  # real PEFT patterns are tens of nodes; this compiles in ~5 ms into ~3 MB
_REPEATS = frozenset({"MAX_REPEAT", "MIN_REPEAT", "POSSESSIVE_REPEAT"})
_ASSERTS = frozenset({"ASSERT", "ASSERT_NOT"})
_SET_OPERATORS = ("--", "&&", "||", "~~")  # set operations to `regex` (V1), warned about by `re`
_COUNTED = re.compile(r"\{(?:\d+|\d+,\d*|,\d+)\}")


class PatternCostError(ValueError):
    """The pattern is invalid, ambiguous between `re` and `regex`, or too large once compiled."""


def pattern_nodes(pattern: str, limit: int = MAX_PATTERN_NODES) -> int:
    """The compiled size bound of `pattern` (at most `limit`, else PatternCostError)."""
    nested_set, loose_brace = _divergent_syntax(pattern)
    if nested_set:  # before parsing, where re would warn about it
        raise PatternCostError(
            "has a '[' or a set operator (--, &&, ||, ~~) inside a character class; escape the characters"
        )
    try:
        tree = _PARSER.parse(pattern)
    except (re.error, OverflowError, RecursionError, ValueError) as e:
        raise PatternCostError(f"is an invalid regular expression ({e})") from None
    if loose_brace:
        raise PatternCostError(
            "has a '{' that is not a counted repeat such as {2} or {1,3}; write \\{ for the character"
        )
    nodes = _size(tree, limit)
    if nodes > limit:
        raise PatternCostError(
            f"would compile to more than {limit} regex nodes (counted repeats such as {{1000}}, nested or "
            "large, are unrolled by the compiler); use a list of module names or smaller repeats"
        )
    return nodes


def _size(items: Any, limit: int) -> int:
    """Nodes of a parsed sub-pattern, repeats counted at their largest unrolling; stops past `limit`."""
    total = 0
    for op, av in items:
        if op.name in _REPEATS:
            low, high, body = av
            times = low + 1 if high == _PARSER.MAXREPEAT else high
            total += 1 + max(times, 1) * _size(body, limit)
        elif op.name == "IN":
            total += 1 + len(av)
        elif op.name in _ASSERTS and av[0] < 0 and len(set(av[1].getwidth())) != 1:
            # What only re's compiler refuses; it is not run, since it walks each case-insensitive
            # range code point by code point (seconds for a few hundred [\x00-\U0010ffff]).
            raise PatternCostError(
                "is an invalid regular expression (look-behind requires fixed-width pattern)"
            )
        else:
            total += 1 + sum(_size(sub, limit) for sub in _subpatterns(av))
        if total > limit:
            return total
    return total


def _subpatterns(av: Any) -> list[Any]:
    """The sub-patterns inside one node's argument (groups, branches, lookarounds, conditionals)."""
    if isinstance(av, _PARSER.SubPattern):
        return [av]
    if isinstance(av, tuple | list):
        return [sub for part in av for sub in _subpatterns(part)]
    return []


def _divergent_syntax(pattern: str) -> tuple[bool, bool]:
    """Whether `pattern` has a `[` or a set operator inside a character class, and a `{` outside one
    that is not a plain counted repeat: the spellings `regex` reads otherwise than `re` (or may)."""
    i, n, in_set, loose_brace = 0, len(pattern), False, False
    while i < n:
        char = pattern[i]
        if char == "\\":
            i += 2
            continue
        if in_set:
            if char == "]":
                in_set = False
            elif char == "[" or pattern.startswith(_SET_OPERATORS, i):
                return True, loose_brace
        elif char == "[":
            in_set = True
            i += 1
            i += pattern.startswith("^", i)
            i += pattern.startswith("]", i)  # a leading ']' is a member, not the end
            continue
        elif char == "{" and not _COUNTED.match(pattern, i):
            loose_brace = True
        i += 1
    return False, loose_brace
