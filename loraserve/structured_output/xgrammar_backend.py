"""The xgrammar backend: the tokenizer's vocabulary for xgrammar, compiling a `GrammarKey` in this
process (`grammar_compile.compile_key`: the budget, vLLM's error texts), reading back a grammar a
compile worker made, and creating per-sequence matchers.

Chosen by measurement on this CPU class (see docs/DESIGN.md, Structured outputs): a nested JSON
schema compiles in ~22 ms at a 49k vocabulary (~100 ms at 150k) and the 32 masks of a step fill in
well under a millisecond; llguidance compiles lazily (~1-3 ms) but fills masks ~5-10x slower.
"""

from __future__ import annotations

import logging
import os
from typing import Any

import xgrammar as xgr

from loraserve.structured_output.grammar_cache import GrammarCache
from loraserve.structured_output.grammar_compile import GrammarCompileError, compile_key
from loraserve.structured_output.params import GrammarKey

__all__ = ["GrammarCompileError", "XGrammarBackend"]

logger = logging.getLogger(__name__)


class XGrammarBackend:
    """One per engine, built on the first structured request (the vocabulary scan takes ~0.5 s at
    49k tokens, which engines that never see one should not pay)."""

    def __init__(self, tokenizer: Any, vocab_size: int, stop_token_ids: list[int], cache_size: int) -> None:
        self.info = xgr.TokenizerInfo.from_huggingface(
            tokenizer, vocab_size=vocab_size, stop_token_ids=stop_token_ids
        )
        threads = max(1, min(8, os.cpu_count() or 1))
        # xgrammar's own cache is off: ours is keyed by the request's constraint and counts hits.
        self.compiler = xgr.GrammarCompiler(self.info, max_threads=threads, cache_enabled=False)
        self.vocab_size = vocab_size
        self.cache: GrammarCache[xgr.CompiledGrammar] = GrammarCache(cache_size)

    def compile(self, key: GrammarKey) -> xgr.CompiledGrammar:
        """`key`'s grammar from the cache, else compiled here (the offline engine's path)."""
        return self.cache.get_or_compile(key, lambda k: compile_key(self.compiler, k))

    def tokenizer_info_json(self) -> str:
        """The vocabulary as xgrammar serialises it: what a compile worker process starts from."""
        return str(self.info.serialize_json())

    def load(self, key: GrammarKey, serialized: str) -> xgr.CompiledGrammar:
        """A grammar a compile worker made for `key` (its serialised form), now in the cache."""
        compiled = xgr.CompiledGrammar.deserialize_json(serialized, self.info)
        self.cache.put(key, compiled)
        return compiled

    def matcher(self, compiled: xgr.CompiledGrammar) -> xgr.GrammarMatcher:
        return xgr.GrammarMatcher(compiled)
