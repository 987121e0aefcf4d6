"""The xgrammar backend: the tokenizer's vocabulary for xgrammar, compiling a `GrammarKey` (with
vLLM's error texts) and creating per-sequence matchers.

Chosen by measurement on this CPU class (see docs/DESIGN.md, Structured outputs): a nested JSON
schema compiles in ~22 ms at a 49k vocabulary (~100 ms at 150k) and the 32 masks of a step fill in
well under a millisecond; llguidance compiles lazily (~1-3 ms) but fills masks ~5-10x slower.
"""

from __future__ import annotations

import json
import logging
import os
import re
from typing import Any

import xgrammar as xgr

from loraserve.structured_output.grammar_cache import GrammarCache
from loraserve.structured_output.params import GrammarKey

logger = logging.getLogger(__name__)

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
    """A constraint that does not compile: the client's error (400), with vLLM's text."""


def has_unsupported_json_features(schema: Any) -> bool:
    """Whether the schema uses a keyword xgrammar would not enforce (vLLM refuses those too)."""
    if isinstance(schema, list):
        return any(has_unsupported_json_features(item) for item in schema)
    if not isinstance(schema, dict):
        return False
    kind = schema.get("type")
    if isinstance(kind, str) and any(word in schema for word in _UNSUPPORTED.get(kind, ())):
        return True
    if kind == "string" and "format" in schema and schema["format"] not in _STRING_FORMATS:
        return True
    return any(has_unsupported_json_features(value) for value in schema.values())


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar matching exactly one of `choices`."""
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in choices)


class XGrammarBackend:
    """One per engine, built on the first structured request (the vocabulary scan takes ~0.5 s at
    49k tokens, which engines that never see one should not pay)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int) -> None:
        info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        threads = max(1, min(8, os.cpu_count() or 1))
        # xgrammar's own cache is off: ours is keyed by the request's constraint and counts hits.
        self.compiler = xgr.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache: GrammarCache[xgr.CompiledGrammar] = GrammarCache(cache_size)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        return self.cache.get_or_compile(key, self._compile)

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)

    def _compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        if key.kind == "json":
            if has_unsupported_json_features(json.loads(key.text)):
                raise GrammarCompileError(
                    "The provided JSON schema contains features not supported by xgrammar."
                )
            return self._attempt(
                "Failed to transform json schema into a grammar",
                lambda: self.compiler.compile_json_schema(key.text, any_whitespace=key.any_whitespace),
            )
        if key.kind == "json_object":
            # Any JSON object, as OpenAI's json_object mode promises (xgrammar's builtin JSON grammar,
            # which vLLM uses, also admits arrays and scalars).
            return self.compiler.compile_json_schema('{"type": "object"}', any_whitespace=key.any_whitespace)
        if key.kind == "regex":
            return self._attempt(
                "Failed to transform regex into a grammar", lambda: self.compiler.compile_regex(key.text)
            )
        if key.kind == "choice":
            text = choice_grammar(json.loads(key.text))
            return self._attempt(
                "Failed to transform choices into a grammar", lambda: self.compiler.compile_grammar(text)
            )
        if key.kind == "grammar":
            return self._attempt(
                "Invalid grammar specification", lambda: self.compiler.compile_grammar(key.text)
            )
        return self._attempt("Invalid structural tag specification", lambda: self._structural_tag(key.text))

    def _structural_tag(self, text: str) -> xgr.CompiledGrammar:
        """vLLM's two structural-tag forms: {"structures": [...], "triggers": [...]}, else xgrammar's own."""
        tag = json.loads(text)
        if isinstance(tag, dict) and "structures" in tag:
            items = [
                xgr.StructuralTagItem(begin=s["begin"], schema=json.dumps(s["schema"]), end=s["end"])
                for s in tag["structures"]
            ]
            return self.compiler.compile_structural_tag(items, tag["triggers"])
        return self.compiler.compile_structural_tag(text)

    @staticmethod
    def _attempt(what: str, compile_fn: Any) -> xgr.CompiledGrammar:
        try:
            return compile_fn()
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError subclasses with its reason
            text = str(exc).strip()
            reason = _LOCATION.sub("", text.splitlines()[0]) if text else type(exc).__name__
            raise GrammarCompileError(f"{what}: {reason}") from exc
