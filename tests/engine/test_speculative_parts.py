"""Speculative decoding's parts on their own: the config (vLLM's JSON and its refusals), the
incremental n-gram index (equal to a fresh one at every length), the adaptive plan and its estimates,
vLLM's disable_by_batch_size in the engine, and the spec_decode metric families."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from loraserve import LLM, SamplingParams
from loraserve.engine.arg_utils import EngineArgs
from loraserve.engine.ngram_index import NgramIndex
from loraserve.engine.spec_policy import PRIOR_ACCEPTANCE, Acceptance, Candidate, StepCosts, plan_drafts
from loraserve.options import OptionError
from loraserve.speculative_config import SpeculativeConfig


def test_config_takes_vllms_spelling_and_defaults() -> None:
    ngram = SpeculativeConfig.from_options({"method": "ngram", "num_speculative_tokens": 3})
    assert (ngram.prompt_lookup_min, ngram.prompt_lookup_max, ngram.draft_policy) == (5, 5, "adaptive")
    one = SpeculativeConfig.from_options(
        {"method": "[ngram]", "num_speculative_tokens": 2, "prompt_lookup_max": 4}
    )
    assert (one.method, one.prompt_lookup_min, one.prompt_lookup_max) == ("ngram", 4, 4)
    draft = SpeculativeConfig.from_options(
        {
            "model": "d.gguf",
            "num_speculative_tokens": 4,
            "disable_by_batch_size": 8,
            "draft_tensor_parallel_size": 1,
            "draft_lora_modules": {"sql": "/adapters/sql-draft"},
        }  # fmt: skip
    )
    assert (draft.method, draft.disable_by_batch_size, dict(draft.draft_lora_modules)) == (
        "draft_model",
        8,
        {"sql": "/adapters/sql-draft"},
    )


@pytest.mark.parametrize(
    "values, message",
    [
        ({"method": "eagle3", "model": "x", "num_speculative_tokens": 2}, "needs trained heads"),
        ({"method": "lookahead", "num_speculative_tokens": 2}, "is unknown"),
        ({"num_speculative_tokens": 2}, "needs a 'method'"),
        (
            {"method": "ngram", "num_speculative_tokens": 0},
            "num_speculative_tokens must be an integer in 1..32",
        ),
        ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens must be an integer"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
            "must be <=",
        ),
        ({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 0}, "must be an integer > 0"),
        ({"method": "ngram", "num_speculative_tokens": 2, "model": "x"}, "draft model's field"),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_lora_modules": {"a": "b"}},
            "needs a draft 'model'",
        ),
        ({"model": "x", "num_speculative_tokens": 2, "prompt_lookup_max": 3}, "ngram method's field"),
        (
            {"model": "x", "num_speculative_tokens": 2, "draft_lora_modules": {"a": 3}},
            "draft_lora_modules must be",
        ),
        (
            {"model": "x", "num_speculative_tokens": 2, "draft_tensor_parallel_size": 2},
            "runs in this process",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "draft_policy": "eager"},
            "draft_policy must be one of",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "disable_by_batch_size": 0},
            "must be an integer > 0",
        ),
        (
            {"method": "ngram", "num_speculative_tokens": 2, "num_lookahead": 3},
            "unknown field(s): num_lookahead",
        ),
    ],
)
def test_config_refuses_what_it_cannot_serve(values: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)").replace(".", r"\.")):
        SpeculativeConfig.from_options(values)
    with pytest.raises(OptionError, match="speculative_config is not valid"):  # before anything loads
        EngineArgs(model="unused", speculative_config=values)


def test_ngram_index_is_a_fresh_lookup_at_every_length() -> None:
    """Fed one token at a time (as a sequence grows), the incremental index proposes what an index
    built from scratch on the same tokens proposes, and indexes each position once."""
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 6, (300,), generator=g).tolist()
    incremental = NgramIndex(2, 4)
    for length in range(1, len(tokens) + 1):
        prefix = tokens[:length]
        assert incremental.propose(prefix, 5) == NgramIndex(2, 4).propose(prefix, 5)
        assert incremental.indexed == length - 1
    assert sum(len(t) for t in incremental.tables.values()) <= 3 * len(tokens)


def test_ngram_index_prefers_the_longest_latest_match_and_repeats_a_period() -> None:
    index = NgramIndex(1, 3)
    # "9 1 2" occurred once (followed by 7); "2" alone last occurred before 5: the longer match wins.
    assert index.propose([9, 1, 2, 7, 1, 2, 5, 9, 1, 2], 2) == [7, 1]
    assert NgramIndex(1, 1).propose([3, 4, 3, 5, 3], 2) == [5, 3]  # the latest occurrence of "3"
    assert NgramIndex(2, 2).propose([1, 2, 1, 2], 5) == [1, 2, 1, 2, 1]  # the period continues
    assert NgramIndex(2, 2).propose([1, 2, 3], 4) == []  # nothing repeats


def test_the_plan_takes_many_proposals_alone_and_only_sure_ones_in_a_batch() -> None:
    costs = StepCosts()  # the prior: each extra row costs about a third of a one-row step
    alone = plan_drafts([Candidate(1, 0.95, 10)], 1, 1, costs, budget=100)
    assert alone[1] >= 5
    assert plan_drafts([Candidate(1, 0.2, 10)], 1, 1, costs, budget=100) == {}  # backs off
    assert plan_drafts([Candidate(1, 0.95, 10)], 1, 1, costs, budget=2) == {1: 2}
    # A batch of 16 on a machine whose steps double past 24 rows (a quantized kernel's switch).
    measured = StepCosts()
    for rows in range(16, 33):
        measured.observe(rows, 0.05 + 0.004 * rows + (0.1 if rows > 24 else 0.0))
    batch = [Candidate(i, 0.97 if i < 4 else 0.6, 6) for i in range(16)]
    plan = plan_drafts(batch, 16, 16, measured, budget=1000)
    assert 0 < sum(plan.values()) <= 8 and set(plan) <= {0, 1, 2, 3}
    # A draft model's pass per depth makes deep proposals dearer.
    deep = plan_drafts([Candidate(1, 0.9, 10)], 1, 1, costs, budget=100, pass_cost=0.0)[1]
    assert plan_drafts([Candidate(1, 0.9, 10)], 1, 1, costs, budget=100, pass_cost=0.3).get(1, 0) < deep


def test_estimates_follow_what_they_observe() -> None:
    costs = StepCosts()
    costs.observe(1, 0.010)
    costs.observe(5, 0.020)
    costs.observe(5, 0.030)
    assert costs.table() == {1: 0.010, 5: pytest.approx(0.025)}  # the medians of what each row count took
    costs.observe(5, 0.020)
    assert costs.estimate(3) == pytest.approx(0.015)  # between measured row counts: interpolated
    assert costs.estimate(9) == pytest.approx(
        0.020 * (0.65 + 0.35 * 9) / (0.65 + 0.35 * 5)
    )  # beyond: the prior's slope
    acceptance = Acceptance()
    acceptance.observe(proposed=4, accepted=0)
    low = acceptance.rate
    assert low < PRIOR_ACCEPTANCE
    acceptance.observe(proposed=4, accepted=4)
    assert acceptance.rate > low
    engine = Acceptance(rate=0.95)  # the engine's for this kind of proposal
    own = Acceptance(rate=0.2, tried=40.0)
    assert own.blended(engine) < 0.4  # a sequence that tried a lot is judged by itself
    for _ in range(500):
        own.held_back()  # a held-back sequence's tries fade: the engine's average decides again
    assert own.blended(engine) == pytest.approx(0.95, abs=0.01)
    for _ in range(5000):
        engine.unused()  # a kind nobody tries drifts back to the prior
    assert engine.rate == pytest.approx(PRIOR_ACCEPTANCE, abs=0.01)


def test_disable_by_batch_size_stops_proposals_in_a_big_batch(tiny_model: Any) -> None:
    config = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 2,
              "draft_policy": "always"}  # fmt: skip
    prompts = [{"prompt_token_ids": [5, 6, 7, 8] * 4 + [i + 20]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    counts = []
    for limit in (None, 3):
        llm = LLM(tiny_model("llama"), dtype="float32", max_model_len=128, kv_cache_memory_bytes=4 << 20,
                  speculative_config={**config, "disable_by_batch_size": limit})  # fmt: skip
        llm.generate(prompts, params, use_tqdm=False)
        counts.append(sum(c["num_drafts"] for c in llm.engine.stats().get("spec_decode", {}).values()))
    assert counts[0] > 0 and counts[1] == 0  # four requests in flight the whole time: more than 3


def test_spec_decode_metric_families() -> None:
    from loraserve.entrypoints.openai.metrics.engine_metrics import stats_families
    from loraserve.entrypoints.openai.metrics.vllm_metrics import vllm_engine_families

    spec = {
        "sql": {
            "num_drafts": 3,
            "num_draft_tokens": 9,
            "num_accepted_tokens": 5,
            "accepted_per_pos": [3, 2, 0],
        }
    }
    families = {f.name: f for f in vllm_engine_families({"spec_decode": spec}, "m")}
    drafts = families["vllm:spec_decode_num_drafts"]
    assert drafts.type == "counter"
    assert [(s.labels, s.value) for s in drafts.samples if s.name.endswith("_total")] == [
        ({"model_name": "m", "engine": "0", "lora_name": "sql"}, 3.0)
    ]
    per_pos = families["vllm:spec_decode_num_accepted_tokens_per_pos"]
    assert [(s.labels["position"], s.value) for s in per_pos.samples if s.name.endswith("_total")] == [
        ("0", 3.0),
        ("1", 2.0),
        ("2", 0.0),
    ]
    assert families["vllm:spec_decode_num_accepted_tokens"].samples[0].value == 5.0
    assert not [f for f in stats_families({"spec_decode": spec}, 0.0) if "spec_decode" in f.name]


def test_verification_rows_are_the_decode_steps_bit_for_bit(tiny_model: Any) -> None:
    """A round's rows (its own token, then 8 proposals) against 9 decode steps of the same positions, at a
    context long enough for the attention kernel to shape a many-query item otherwise: equal bits."""
    from loraserve.engine.sequence import DraftRound
    from loraserve.engine.step_types import ScheduledSeq

    llm = LLM(tiny_model("llama"), dtype="float32", max_model_len=256, kv_cache_memory_bytes=4 << 20)
    engine = llm.engine
    engine.add_request("r", {"prompt_token_ids": [(i * 7) % 300 + 10 for i in range(200)]},
                       SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))  # fmt: skip
    seq = engine.requests["r"].seqs[0]
    while seq.num_output_tokens < 12:
        engine.step()
    tokens, first = list(seq.token_ids), seq.num_tokens - 10
    decode = []
    for i in range(9):
        seq.num_computed_tokens, seq.token_ids[:] = first + i, tokens[: first + i + 1]
        decode.append(engine.runner.execute([ScheduledSeq(seq, 1)], None).logits[0])
    seq.num_computed_tokens, seq.token_ids[:] = first, tokens[: first + 1]
    rows = engine.runner.execute(
        [ScheduledSeq(seq, 1, DraftRound(tokens[first + 1 : first + 9]))], None
    ).logits
    seq.token_ids[:] = tokens
    assert rows.shape[0] == 9 and all(torch.equal(rows[i], decode[i]) for i in range(9))


def test_the_serve_flag_reaches_the_engine_config() -> None:
    from loraserve.entrypoints.openai.cli.cli_args import parse_serve_args

    value = (
        '{"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4, "disable_by_batch_size": 8}'
    )
    args = EngineArgs.from_cli_args(parse_serve_args(["some/model", "--speculative-config", value]))
    assert args.speculative_config == {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 4,
                                       "disable_by_batch_size": 8}  # fmt: skip
    config = SpeculativeConfig.from_options(args.speculative_config)
    assert (config.prompt_lookup_min, config.disable_by_batch_size) == (4, 8)
