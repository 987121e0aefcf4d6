r"""The compiled-size bound on adapter-config regexes (`pattern_cost.py`, used by `patterns.py`).

Each rule has a pattern it refuses and patterns it must still accept: PEFT's real ones
(`.*\.(q_proj|v_proj)$`, `model\.layers\.\d+\.self_attn\.(q|k|v)_proj`) and small counted repeats.
Memory is measured with tracemalloc (a count of bytes, which sees `regex`'s parser and compiler),
never with a clock.
"""

from __future__ import annotations

import re
import tracemalloc
from collections.abc import Callable
from typing import Any

import pytest
import regex

from loraserve.errors import LoRAAdapterError
from loraserve.lora.pattern_cost import MAX_PATTERN_NODES, PatternCostError, pattern_nodes
from loraserve.lora.patterns import MAX_ADAPTER_NODES, PatternMatcher, key_regex, layers_regex
from loraserve.lora.peft_helper import PEFTHelper

REPRO = "(?:(?:(?:a{1000}){1000}){1000})"  # 32 characters, a billion nodes once regex unrolls it
ACCEPTED = [
    r".*\.(q_proj|v_proj)$",
    r"model\.layers\.\d+\.self_attn\.(q|k|v)_proj",
    r".*decoder.*(SelfAttention|EncDecAttention).*(q|v)$",
    r"model\.layers\.(?:[0-9]|1[0-5])\.mlp\.(gate|up|down)_proj",
    r"layers\.\d{1,3}\.self_attn\.o_proj",  # a small counted repeat
    r"(?:(?:ab){10}){10}",  # nested but small: 211 nodes
    r"(?:a{30}){30}",
    r"(?:x\{1\}|[\[\]]|[{}-])",  # escaped braces and brackets, and braces in a set, are characters
    r"(?=.*q_proj)(?!.*lm_head).*",
    "a" * 4000,
]
TOO_LARGE = [
    REPRO,
    "(?:a{1000}){1000}",
    "(?:a{1000}){1,1000}",  # a counted range counts at its top
    "(?:a{5000}){2,}",  # unbounded: m + 1 copies
    "a{20000}",
    ".{0,100000}",
    "(?:(?:.{10}){100}){100}",
    "(a|b|c|d){3000}",
    f"(?:x{{{MAX_PATTERN_NODES}}})",
]
DIVERGENT = {  # `regex` reads these otherwise than `re` (PEFT's reading): refused, not guessed
    "(?:q_proj){e<=1}": "'{' that is not a counted repeat",
    r"q_proj\.\d{1, 2}": "'{' that is not a counted repeat",
    "a{}": "'{' that is not a counted repeat",
    "[[:alpha:]]+_proj": "inside a character class",
    "[a-z--q]_proj": "inside a character class",  # a set difference to regex's V1
}
INVALID = ["(", "a)", "(?P<x>a)(?P<x>b)", "(?<=a+)b", "a{4294967296}", r"\p{L}+", "(" * 3000 + ")" * 3000]


@pytest.mark.parametrize("pattern", ACCEPTED)
def test_real_and_small_patterns_are_accepted_and_compile_small(pattern: str) -> None:
    nodes = pattern_nodes(pattern)
    assert 0 < nodes <= MAX_PATTERN_NODES
    peak = _peak_bytes(lambda: regex.compile(pattern))
    assert peak < 20_000 * (nodes + 10), (nodes, peak)  # measured: ~300 bytes a node


@pytest.mark.parametrize("pattern", TOO_LARGE)
def test_patterns_that_unroll_past_the_bound_are_refused_unparsed_by_regex(pattern: str) -> None:
    with pytest.raises(PatternCostError, match=f"more than {MAX_PATTERN_NODES} regex nodes"):
        pattern_nodes(pattern)


def test_the_bound_is_the_largest_unrolling() -> None:
    """Exact counts: a repeat counts its body at its top count, or m + 1 copies when unbounded."""
    assert pattern_nodes("a") == 1
    assert pattern_nodes("a{7}") == 1 + 7
    assert pattern_nodes("a{2,9}") == 1 + 9
    assert pattern_nodes("a{4,}") == 1 + 5
    assert pattern_nodes("a*") == 1 + 1
    assert pattern_nodes("(?:a{3}){5}") == 1 + 5 * (1 + 3)


def test_near_the_bound_compiles_within_a_few_megabytes() -> None:
    """What an accepted pattern can cost at most: patterns just under the bound, of each shape."""
    for pattern in ("(?:a{1000}){9}", "(?:(?:(?:a{21}){21}){21})", "(?:(?:a|b){10}){300}", "." * 4096):
        nodes = pattern_nodes(pattern)
        assert nodes > MAX_PATTERN_NODES // 3
        assert _peak_bytes(lambda p=pattern: regex.compile(p)) < 32 << 20


@pytest.mark.parametrize("pattern", list(DIVERGENT))
def test_syntax_that_regex_reads_otherwise_than_re_is_refused(pattern: str) -> None:
    with pytest.raises(PatternCostError, match=re.escape(DIVERGENT[pattern])):
        pattern_nodes(pattern)


@pytest.mark.parametrize("pattern", INVALID)
def test_what_re_cannot_parse_is_invalid(pattern: str) -> None:
    with pytest.raises(PatternCostError, match="invalid regular expression"):
        pattern_nodes(pattern)


@pytest.mark.parametrize(
    ("field", "config"),
    [
        ("target_modules", {"target_modules": REPRO}),
        ("exclude_modules", {"target_modules": ["q_proj"], "exclude_modules": REPRO}),
        ("rank_pattern", {"rank_pattern": {REPRO: 4}}),
        ("alpha_pattern", {"alpha_pattern": {REPRO: 4}}),
        (
            "layers_pattern",
            {"target_modules": ["q_proj"], "layers_to_transform": [0], "layers_pattern": REPRO},
        ),
    ],
)
def test_the_repro_in_each_field_is_a_400_costing_no_memory(field: str, config: dict[str, Any]) -> None:
    """The issue's pattern is refused in every field that holds a pattern, naming adapter and field,
    before `regex` sees it: under 1 MB allocated (it took 6 GB)."""
    full = {"peft_type": "LORA", "r": 8, "lora_alpha": 16, "target_modules": ["q_proj"], **config}
    errors: list[LoRAAdapterError] = []

    def load() -> None:
        with pytest.raises(LoRAAdapterError) as info:
            PEFTHelper.from_dict(full, "bomb", max_lora_rank=16)
        errors.append(info.value)

    assert _peak_bytes(load) < 1 << 20
    message = str(errors[0])
    assert "LoRA adapter 'bomb'" in message and f"field '{field}'" in message
    assert "regex nodes" in message


def test_peft_patterns_still_match_as_peft_does() -> None:
    helper = PEFTHelper.from_dict(
        {
            "peft_type": "LORA",
            "r": 8,
            "lora_alpha": 16,
            "target_modules": r"model\.layers\.\d{1,2}\.self_attn\.(q|k|v)_proj",
            "rank_pattern": {r"layers\.1\.self_attn\.q_proj": 4},
        },
        "ok",
        max_lora_rank=16,
    )
    assert helper.targets_module("model.layers.3.self_attn.k_proj")
    assert not helper.targets_module("model.layers.3.self_attn.o_proj")
    assert not helper.targets_module("model.layers.123.self_attn.q_proj")  # \d{1,2}
    assert helper.rank_for("model.layers.1.self_attn.q_proj") == 4
    assert helper.rank_for("model.layers.11.self_attn.q_proj") == 8


def test_an_adapter_s_patterns_share_one_node_budget() -> None:
    """Many keys just under the per-pattern bound: refused once the adapter's total passes its own."""
    body = f"x{{{MAX_PATTERN_NODES - 50}}}"
    per_key = pattern_nodes(key_regex(body))
    fits = MAX_ADAPTER_NODES // per_key
    keys = {f"{body}|k{i}": 4 for i in range(fits + 1)}
    with pytest.raises(LoRAAdapterError, match=rf"rank_pattern.*past {MAX_ADAPTER_NODES} regex nodes in all"):
        PEFTHelper.from_dict({"r": 8, "target_modules": ["q_proj"], "rank_pattern": keys}, "many", 16)
    few = dict(list(keys.items())[:fits])
    assert (
        len(
            PEFTHelper.from_dict(
                {"r": 8, "target_modules": ["q_proj"], "rank_pattern": few}, "ok", 16
            ).rank_pattern
        )
        == fits
    )


def test_matcher_names_the_field_and_caches_compiled_patterns() -> None:
    matcher = PatternMatcher("m")
    first = matcher.compile(layers_regex("layers"), "layers_pattern")
    assert matcher.compile(layers_regex("layers"), "layers_pattern") is first
    with pytest.raises(LoRAAdapterError, match="LoRA adapter 'm': the pattern in field 'target_modules'"):
        matcher.compile("[[:digit:]]", "target_modules")


def _peak_bytes(fn: Callable[[], object]) -> int:
    regex.purge()
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
        regex.purge()
