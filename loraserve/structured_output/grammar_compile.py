"""Compiling one `GrammarKey` with xgrammar: the budget a constraint must fit before anything
compiles it, and vLLM's error texts for one that does not compile.

Shared by the in-process backend (the offline `LLM`, `xgrammar_backend.py`) and the compile worker
processes the server uses (`compile_worker.py`). Compile time grows faster than the square of a
regex's length (`".*"` x 400: ~10 s on an AVX2 EPYC), so a size budget alone cannot bound it: the
server's compiles also run under a timeout, in a process that can be killed (`compile_pool.py`). The
budget is what can be refused at once: the constraint's text (`MAX_GRAMMAR_SOURCE_CHARS`), a schema's
JSON nesting (`json_limits.MAX_JSON_DEPTH`), and the grammar xgrammar builds from it
(`MAX_GRAMMAR_CHARS` of EBNF), checked before its token masks are computed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from typing import Any

from loraserve.json_limits import check_json_depth, loads_bounded
from loraserve.structured_output.params import GrammarKey

# A constraint's own text: a tool list's schema with a hundred tools is ~100 KB.
MAX_GRAMMAR_SOURCE_CHARS = 256 * 1024
# The EBNF xgrammar builds from it: ~12x a schema's text, ~17x a regex's.
MAX_GRAMMAR_CHARS = 4 << 20

# String formats xgrammar enforces (vLLM's list); a schema with another format is refused, since
# its output would not validate.
_STRING_FORMATS = frozenset(
    (
        "email",
        "date",
        "time",
        "date-time",
        "duration",
        "ipv4",
        "ipv6",
        "hostname",
        "uuid",
        "uri",
        "uri-reference",
        "uri-template",
        "json-pointer",
        "relative-json-pointer",
    )
)
_UNSUPPORTED = {
    "integer": ("multipleOf",),
    "number": ("multipleOf",),
    "array": ("uniqueItems", "contains", "minContains", "maxContains"),
    "object": ("minProperties", "maxProperties", "propertyNames", "patternProperties"),
}
# xgrammar prefixes its messages with "[hh:mm:ss] /its/source.cc:line: ", which names no client error.
_LOCATION = re.compile(r"^\[[0-9:]+\] \S+:[0-9]+: ")


class GrammarCompileError(ValueError):
    """A constraint that does not compile, or does not fit the budget: the client's error (400), with
    vLLM's text; `parameter` is the request field that carried it, when known."""

    def __init__(self, message: str, parameter: str | None = None) -> None:
        super().__init__(message)
        self.parameter = parameter


def check_budget(key: GrammarKey, parameter: str | None = None) -> None:
    """GrammarCompileError when the constraint's text is over the budget (before any compile)."""
    if len(key.text) > MAX_GRAMMAR_SOURCE_CHARS:
        raise GrammarCompileError(
            f"The {_NAMES[key.kind]} is {len(key.text)} characters long; at most "
            f"{MAX_GRAMMAR_SOURCE_CHARS} are compiled.",
            parameter,
        )
    if key.kind in ("json", "structural_tag", "choice"):
        check_json_depth(key.text, f"The {_NAMES[key.kind]}", parameter)


_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object constraint",
    "regex": "regex",
    "choice": "choice list",
    "grammar": "grammar",
    "structural_tag": "structural tag",
}


def has_unsupported_json_features(schema: Any) -> bool:
    """Whether the schema uses a keyword xgrammar would not enforce (vLLM refuses those too). Walked
    without recursion (the schema's depth is bounded, but the caller's stack is not ours to spend)."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
            continue
        if not isinstance(item, dict):
            continue
        kind = item.get("type")
        if isinstance(kind, str) and any(word in item for word in _UNSUPPORTED.get(kind, ())):
            return True
        if kind == "string" and "format" in item and item["format"] not in _STRING_FORMATS:
            return True
        stack.extend(item.values())
    return False


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


def compile_key(compiler: Any, key: GrammarKey) -> Any:
    """`key` compiled by an `xgrammar.GrammarCompiler`: the grammar built, its size checked, then its
    token masks computed. GrammarCompileError (vLLM's texts) when it does not compile."""

    check_budget(key)
    what, build = _BUILDERS[key.kind]
    if key.kind == "json" and has_unsupported_json_features(loads_bounded(key.text, "The JSON schema")):
        raise GrammarCompileError("The provided JSON schema contains features not supported by xgrammar.")
    grammar = _attempt(what, lambda: build(key))
    size = len(str(grammar))
    if size > MAX_GRAMMAR_CHARS:
        raise GrammarCompileError(
            f"The {_NAMES[key.kind]} makes a grammar of {size} characters; at most {MAX_GRAMMAR_CHARS} "
            "are compiled."
        )
    return _attempt(what, lambda: compiler.compile_grammar(grammar))


def _json_schema(key: GrammarKey) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_json_schema(key.text, any_whitespace=key.any_whitespace)


def _json_object(key: GrammarKey) -> Any:
    # Any JSON object, as OpenAI's json_object mode promises (xgrammar's builtin JSON grammar, which
    # vLLM uses, also admits arrays and scalars).
    import xgrammar as xgr

    return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=key.any_whitespace)


def _regex(key: GrammarKey) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_regex(key.text)


def _choice(key: GrammarKey) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(choice_grammar(json.loads(key.text)))


def _ebnf(key: GrammarKey) -> Any:
    import xgrammar as xgr

    return xgr.Grammar.from_ebnf(key.text)


def _structural_tag(key: GrammarKey) -> Any:
    """vLLM's two structural-tag forms: {"structures": [...], "triggers": [...]}, else xgrammar's own."""
    import xgrammar as xgr

    tag = json.loads(key.text)
    if isinstance(tag, dict) and "structures" in tag:
        items = [
            xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
            for s in tag["structures"]
        ]
        return xgr.Grammar.from_structural_tag(items, tag["triggers"])
    return xgr.Grammar.from_structural_tag(key.text)


# kind -> (vLLM's text for a failure, how its grammar is built)
_BUILDERS: dict[str, tuple[str, Callable[[GrammarKey], Any]]] = {
    "json": ("Failed to transform json schema into a grammar", _json_schema),
    "json_object": ("Failed to transform json schema into a grammar", _json_object),
    "regex": ("Failed to transform regex into a grammar", _regex),
    "choice": ("Failed to transform choices into a grammar", _choice),
    "grammar": ("Invalid grammar specification", _ebnf),
    "structural_tag": ("Invalid structural tag specification", _structural_tag),
}


def _attempt(what: str, fn: Callable[[], Any]) -> Any:
    try:
        return fn()
    except GrammarCompileError:
        raise
    except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses with its reason
        text = str(exc).strip()
        reason = _LOCATION.sub("", text.splitlines()[0]) if text else type(exc).__name__
        raise GrammarCompileError(f"{what}: {reason}") from exc
