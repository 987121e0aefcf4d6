"""Speculative decoding, ngram method, against the same engine without it (tiny random Llama, float32):
greedy and seeded sampled outputs equal token for token (logprobs too) with adapters in mixed batches,
a grammar, stop strings, n > 1 and preemption; every test also shows that proposals were made and that
some were accepted and some rejected (`stats()["spec_decode"]`), and that no KV block leaks."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from support.speculative import both_ways, repetitive, run, tokens

from loraserve import LLM, SamplingParams
from loraserve.demo.random_model import save_peft_adapter
from loraserve.lora.request import LoRARequest
from loraserve.structured_output.params import StructuredOutputsParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
ALWAYS = {**NGRAM, "draft_policy": "always"}  # every proposal found: the most verification to check
ADAPTERS = {
    "all7": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qv": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]),
}  # fmt: skip
OPTIONS = dict(
    dtype="float32", max_model_len=256, kv_cache_memory_bytes=8 << 20, enable_lora=True, max_loras=2
)


@pytest.fixture(scope="module")
def llama(tiny_model: Any) -> str:
    return tiny_model("llama")


@pytest.fixture(scope="module")
def adapters(llama: str, hf_model: Any, tmp_path_factory: pytest.TempPathFactory) -> dict[str, LoRARequest]:
    root = tmp_path_factory.mktemp("spec-adapters")
    out = {}
    for i, (name, kwargs) in enumerate(ADAPTERS.items()):
        save_peft_adapter(hf_model(llama), str(root / name), seed=40 + i, base_name=llama, **kwargs)
        out[name] = LoRARequest(name, i + 1, str(root / name))
    return out


@pytest.fixture(scope="module")
def base(llama: str) -> LLM:
    return LLM(llama, **OPTIONS)


@pytest.fixture(scope="module")
def spec(llama: str) -> LLM:
    return LLM(llama, **OPTIONS, speculative_config=ALWAYS)


def test_greedy_equals_without_speculation(base: LLM, spec: LLM) -> None:
    prompts = repetitive(6)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, logprobs=2)
    expected, _ = run(base, prompts, params)
    got, counts = run(spec, prompts, params)
    assert tokens(got) == tokens(expected)
    for a, b in zip(got, expected):  # the target's logprobs, whichever row sampled the token
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    both_ways(counts)


def test_seeded_sampling_equals_without_speculation(base: LLM, spec: LLM) -> None:
    """A seeded request samples what it samples without speculation, through every sampling control."""
    prompts = repetitive(7, seed=1)
    banned = prompts[0]["prompt_token_ids"][1]
    allowed = sorted(set(prompts[6]["prompt_token_ids"]))
    params = [
        SamplingParams(temperature=0.8, seed=1, max_tokens=40, ignore_eos=True, logprobs=1),
        SamplingParams(temperature=1.0, top_k=5, top_p=0.9, seed=2, max_tokens=40, ignore_eos=True),
        SamplingParams(temperature=0.7, min_p=0.1, seed=3, max_tokens=40, ignore_eos=True, repetition_penalty=1.2),
        SamplingParams(temperature=0.5, seed=4, max_tokens=40, ignore_eos=True, frequency_penalty=0.3,
                       presence_penalty=0.2, logit_bias={banned: -100.0}),
        SamplingParams(temperature=0.6, seed=5, max_tokens=40, min_tokens=30, stop_token_ids=[prompts[4]["prompt_token_ids"][0]]),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
        SamplingParams(temperature=1.0, seed=6, max_tokens=40, ignore_eos=True, allowed_token_ids=allowed),
    ]  # fmt: skip
    expected, _ = run(base, prompts, params)
    got, counts = run(spec, prompts, params)
    assert tokens(got) == tokens(expected)
    assert got[0].outputs[0].logprobs == expected[0].outputs[0].logprobs
    assert set(tokens(got)[6]) <= set(allowed)
    both_ways(counts)


def test_adapters_in_a_mixed_batch(base: LLM, spec: LLM, adapters: dict[str, LoRARequest]) -> None:
    """Each request's adapter applies to the verification of its proposals; counters per adapter."""
    prompts = repetitive(6, seed=2)
    loras = [adapters["all7"], None, adapters["qv"], adapters["all7"], adapters["qv"], None]
    params = [SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True),
              SamplingParams(temperature=0.9, seed=11, max_tokens=32, ignore_eos=True)] * 3  # fmt: skip
    expected, _ = run(base, prompts, params, loras)
    got, counts = run(spec, prompts, params, loras)
    assert tokens(got) == tokens(expected)
    both_ways(counts)
    assert {"all7", "qv", ""} <= set(spec.engine.stats()["spec_decode"])


def test_grammar_advances_over_accepted_proposals_and_rolls_back(base: LLM, spec: LLM) -> None:
    """A regex grammar: rows after proposals are masked as if the proposals were sampled, and the
    grammar never keeps a rejected one (outputs equal, and every output matches the grammar)."""
    tokenizer = spec.get_tokenizer()
    pattern = "(ab|ba|aab){4,12}"
    params = [
        SamplingParams(
            temperature=t, seed=s, max_tokens=40, structured_outputs=StructuredOutputsParams(regex=pattern)
        )
        for t, s in ((0.0, None), (0.9, 3), (1.2, 4), (0.0, None))
    ]
    prompts = [tokenizer.decode(p["prompt_token_ids"]) + " abab" for p in repetitive(4, seed=3)]
    expected, _ = run(base, prompts, params)
    got, counts = run(spec, prompts, params)
    assert tokens(got) == tokens(expected)
    import re

    for out in got:
        assert re.fullmatch(pattern, out.outputs[0].text), out.outputs[0].text
    assert counts["num_drafts"] > 0 and counts["num_accepted_tokens"] > 0


def test_stops_and_lengths_hold_exactly(base: LLM, spec: LLM) -> None:
    """Stop strings cut where they match, stop ids and max_tokens end the output at the same token,
    even when a step emits several tokens."""
    prompts = repetitive(5, seed=4)
    greedy = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    free, _ = run(base, prompts, greedy)
    texts = [o.outputs[0].text for o in free]
    ids = tokens(free)
    params = [
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[texts[0][12:15]]),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop=[texts[1][20:22]], include_stop_str_in_output=True),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, stop_token_ids=[ids[2][25]]),
        SamplingParams(temperature=0.0, max_tokens=13, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=8, max_tokens=17, ignore_eos=True, stop=[texts[4][5:7]]),
    ]  # fmt: skip
    expected, _ = run(base, prompts, params)
    got, counts = run(spec, prompts, params)
    for a, b in zip(got, expected):
        assert (a.outputs[0].token_ids, a.outputs[0].text) == (b.outputs[0].token_ids, b.outputs[0].text)
        assert (a.outputs[0].finish_reason, a.outputs[0].stop_reason) == (
            b.outputs[0].finish_reason,
            b.outputs[0].stop_reason,
        )
    assert len(got[3].outputs[0].token_ids) == 13 and got[3].outputs[0].finish_reason == "length"
    assert counts["num_accepted_tokens"] > 0


def test_n_and_beam_search_work_beside_it(base: LLM, spec: LLM) -> None:
    """n > 1: each sequence speculates on its own; beam search runs its beams without proposals."""
    from loraserve.beam_search import BeamSearchParams

    prompts = repetitive(2, seed=5)
    params = SamplingParams(n=3, temperature=0.3, seed=21, max_tokens=32, ignore_eos=True)
    expected, _ = run(base, prompts, params)
    got, counts = run(spec, prompts, params)
    assert tokens(got) == tokens(expected) and len(tokens(got)) == 6
    assert counts["num_drafts"] >= 6 and counts["num_draft_tokens"] > counts["num_drafts"]
    beam = BeamSearchParams(beam_width=3, max_tokens=12, ignore_eos=True)
    assert [b.sequences for b in spec.beam_search(prompts, beam)] == [
        b.sequences for b in base.beam_search(prompts, beam)
    ]


def test_preemption_by_a_small_kv_cache(llama: str, base: LLM) -> None:
    """A KV cache too small for the batch: proposals take only free blocks, sequences are preempted and
    recomputed, and the outputs still equal the unconstrained engine's."""
    prompts = repetitive(8, seed=6)
    params = [SamplingParams(temperature=0.0, max_tokens=60, ignore_eos=True),
              SamplingParams(temperature=0.7, seed=31, max_tokens=60, ignore_eos=True)] * 4  # fmt: skip
    expected, _ = run(base, prompts, params)
    small = LLM(
        llama, dtype="float32", max_model_len=128, num_kv_blocks=24, block_size=8, speculative_config=ALWAYS
    )
    got, counts = run(small, prompts, params)
    assert tokens(got) == tokens(expected)
    assert small.engine.scheduler.num_preemptions > 0
    both_ways(counts)


def test_the_prefix_cache_holds_only_kept_tokens(base: LLM, spec: LLM) -> None:
    """Blocks that held rejected proposals enter the prefix cache only with the kept tokens' KV: every
    block both engines cached holds the same KV bits, outputs end on a block boundary (the last
    step's block is the one a premature commit would leave wrong), and a request that extends an
    output reuses its blocks and gets the tokens and logprobs of the engine without speculation."""
    prompts = repetitive(4, seed=7)
    size = spec.engine.block_manager.block_size
    params = [
        SamplingParams(
            temperature=0.0, max_tokens=48 - (len(p["prompt_token_ids"]) + 48) % size, ignore_eos=True
        )
        for p in prompts
    ]
    expected_first, _ = run(base, prompts, params)
    first, counts = run(spec, prompts, params)
    both_ways(counts)  # rejected proposals were written into the KV cache
    assert tokens(first) == tokens(expected_first)
    longer = [
        {"prompt_token_ids": p["prompt_token_ids"] + t + [7, 8]} for p, t in zip(prompts, tokens(first))
    ]
    again = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=3)
    expected, _ = run(base, longer, again)
    hits = spec.engine.block_manager.num_prefix_hit_tokens
    got, _ = run(spec, longer, again)
    # Past the prompts themselves, whole blocks of the first outputs were found in the cache.
    assert spec.engine.block_manager.num_prefix_hit_tokens - hits > sum(
        len(p["prompt_token_ids"]) for p in prompts
    )
    assert tokens(got) == tokens(expected)
    for a, b in zip(got, expected):
        assert a.outputs[0].logprobs == b.outputs[0].logprobs
    assert same_cached_kv(base, spec) > 0


def same_cached_kv(base: LLM, spec: LLM) -> int:
    """How many blocks both engines hold in their prefix caches; asserts their KV is the same bits."""
    ours, theirs = spec.engine.block_manager.cached, base.engine.block_manager.cached
    size = spec.engine.block_manager.block_size
    common = [h for h in ours if h in theirs]
    for h in common:
        a, b = ours[h] * size, theirs[h] * size
        for c1, c2 in zip(spec.engine.runner.kv_caches, base.engine.runner.kv_caches):
            assert torch.equal(c1.k[a : a + size], c2.k[b : b + size]) and torch.equal(
                c1.v[a : a + size], c2.v[b : b + size]
            )
    return len(common)


def test_a_failed_sampling_fails_its_request_alone(
    base: LLM, spec: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One request whose sampling raises while it speculates fails alone; the others of the batch,
    speculating too, are sampled request by request and keep their tokens (seeded ones included)."""
    from loraserve.engine.sampler import Sampler

    prompts = repetitive(3, seed=8)
    params = [
        SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=12, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=666, max_tokens=30, ignore_eos=True),  # the culprit
    ]
    expected, _ = run(base, prompts[:2], params[:2])
    real = Sampler.__call__

    def poisoned(self: Sampler, logits: Any, rows: list[Any]) -> Any:
        # Only a verification row (its noise drawn ahead): the culprit fails while it speculates.
        if any(row.params.seed == 666 and row.noise is not None for row in rows):
            raise RuntimeError("injected fault in one request's sampling")
        return real(self, logits, rows)

    monkeypatch.setattr(Sampler, "__call__", poisoned)
    engine = spec.engine
    before = engine.stats()
    for i, (prompt, p) in enumerate(zip(prompts, params)):
        engine.add_request(f"fail-alone-{i}", prompt["prompt_token_ids"], p)
    last: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            last[out.request_id] = out
    assert "injected fault" in (last["fail-alone-2"].error or "")
    assert [last[f"fail-alone-{i}"].error for i in (0, 1)] == [None, None]
    assert tokens([last["fail-alone-0"], last["fail-alone-1"]]) == tokens(expected)
    stats = engine.stats()
    assert stats["num_step_failures"] == before["num_step_failures"]
    assert stats["num_request_failures"] == before["num_request_failures"] + 1
    assert counters_moved(before, stats)
    assert engine.check_consistency() is None
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


def counters_moved(before: dict[str, Any], after: dict[str, Any]) -> bool:
    """Proposals were verified between two `stats()` snapshots."""

    def drafts(stats: dict[str, Any]) -> int:
        return sum(c["num_drafts"] for c in stats.get("spec_decode", {}).values())

    return drafts(after) > drafts(before)
