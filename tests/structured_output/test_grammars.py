"""Constraint -> grammar key, the compiled-grammar cache, vLLM's refusals and the per-sequence state
(advance, rebuild when tokens go away, dead ends), on the tests' tiny BPE tokenizer."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoTokenizer

from loraserve.structured_output.grammar_cache import GrammarCache
from loraserve.structured_output.params import GrammarKey, StructuredOutputsParams
from loraserve.structured_output.token_mask import disallowed_tokens
from loraserve.structured_output.xgrammar_backend import GrammarCompileError, XGrammarBackend


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir: str):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def backend(tokenizer) -> XGrammarBackend:
    return XGrammarBackend(tokenizer, len(tokenizer), [tokenizer.eos_token_id], cache_size=2)


def test_exactly_one_constraint() -> None:
    with pytest.raises(ValueError, match="only use one kind of structured outputs constraint"):
        StructuredOutputsParams(json={"type": "object"}, regex="a")
    with pytest.raises(ValueError, match="must use one kind"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="unknown field"):
        StructuredOutputsParams.from_dict({"jsn": {}})
    assert StructuredOutputsParams(json='{"type": "object"}').grammar_key() == GrammarKey(
        "json", '{"type": "object"}'
    )
    with pytest.raises(ValueError, match="Invalid JSON grammar specification"):
        StructuredOutputsParams(json="{").grammar_key()


def test_cache_hits_evicts_least_recent_and_keeps_no_failure() -> None:
    cache: GrammarCache[str] = GrammarCache(capacity=2)
    calls: list[str] = []

    def compile_fn(key: GrammarKey) -> str:
        calls.append(key.text)
        if key.text == "bad":
            raise GrammarCompileError("no")
        return key.text.upper()

    a, b, c = (GrammarKey("regex", t) for t in "abc")
    assert cache.get_or_compile(a, compile_fn) == "A"
    assert cache.get_or_compile(a, compile_fn) == "A"
    cache.get_or_compile(b, compile_fn)
    cache.get_or_compile(a, compile_fn)  # a is now the most recent
    cache.get_or_compile(c, compile_fn)  # evicts b
    assert a in cache and c in cache and b not in cache
    assert calls == ["a", "b", "c"] and (cache.hits, cache.misses) == (2, 3)
    with pytest.raises(GrammarCompileError):
        cache.get_or_compile(GrammarKey("regex", "bad"), compile_fn)
    assert len(cache) == 2


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (
            StructuredOutputsParams(json={"type": "array", "uniqueItems": True}),
            "features not supported by xgrammar",
        ),
        (
            StructuredOutputsParams(json={"type": "string", "format": "colour"}),
            "features not supported by xgrammar",
        ),
        (StructuredOutputsParams(regex="(a"), "Failed to transform regex into a grammar: "),
        (StructuredOutputsParams(grammar="root ::= nothing_here"), "Invalid grammar specification: "),
        (StructuredOutputsParams(structural_tag="{not json"), "Invalid structural tag specification: "),
    ],
)
def test_bad_constraints_name_the_error(
    backend: XGrammarBackend, params: StructuredOutputsParams, message: str
) -> None:
    with pytest.raises(GrammarCompileError, match=message.replace("(", r"\(")):
        backend.compile(params.grammar_key())


def test_state_follows_tokens_rebuilds_and_dead_ends(backend: XGrammarBackend, tokenizer) -> None:
    from loraserve.structured_output.grammar_state import GrammarState

    compiled = backend.compile(StructuredOutputsParams(choice=["yes", "no"]).grammar_key())
    state = GrammarState(backend.matcher(compiled))
    ids = tokenizer.encode("yes", add_special_tokens=False)
    bitmask = torch.zeros(1, (len(tokenizer) + 31) // 32, dtype=torch.int32)
    assert state.fill(bitmask, 0)
    first = ~disallowed_tokens(bitmask, len(tokenizer))[0]
    assert first[ids[0]] and not first[tokenizer.eos_token_id]
    state.advance(ids)
    assert state.num_accepted == len(ids) and state.fill(bitmask, 0)
    after = ~disallowed_tokens(bitmask, len(tokenizer))[0]
    assert after.nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # complete: only the stop token
    state.advance(ids[:1])  # fewer tokens than accepted: rebuilt from the start
    assert state.num_accepted == 1 and state.dead_end is None
    state.advance([*ids, tokenizer.eos_token_id, ids[0]])  # a token after the stop token
    assert state.dead_end is not None and not state.fill(bitmask, 0)
    bad = GrammarState(backend.matcher(compiled))
    bad.advance(tokenizer.encode("zzz", add_special_tokens=False))
    assert bad.dead_end is not None and "not allowed" in bad.dead_end


def test_a_grammar_that_raises_ends_its_sequence_alone(backend: XGrammarBackend, tokenizer) -> None:
    from dataclasses import dataclass

    from loraserve.structured_output.grammar_state import GrammarState
    from loraserve.structured_output.manager import StructuredOutputs

    class Broken(GrammarState):
        def fill(self, bitmask, row):  # type: ignore[no-untyped-def]
            raise RuntimeError("matcher state corrupted")

    @dataclass
    class Seq:
        seq_id: int
        grammar: GrammarState
        output_token_ids: list[int]
        num_computed_tokens: int = 0
        num_tokens: int = 0

    @dataclass
    class Item:
        seq: Seq
        num_new_tokens: int = 0

    compiled = backend.compile(StructuredOutputsParams(choice=["yes", "no"]).grammar_key())
    good, bad = (Seq(i, cls(backend.matcher(compiled)), []) for i, cls in ((1, GrammarState), (2, Broken)))
    manager = StructuredOutputs(tokenizer, len(tokenizer), [tokenizer.eos_token_id])
    job = manager.start_step([Item(good), Item(bad)])
    logits = torch.zeros(2, len(tokenizer))
    manager.apply(job, logits, [good, bad])
    assert job is not None and list(job.dead_ends) == [2] and "matcher state corrupted" in job.dead_ends[2]
    assert logits[1].isfinite().nonzero().flatten().tolist() == [tokenizer.eos_token_id]  # stops
    yes = tokenizer.encode("yes", add_special_tokens=False)[0]
    assert logits[0, yes] == 0 and logits[0].isinf().any()  # the good row keeps its own mask
    manager.shutdown()
