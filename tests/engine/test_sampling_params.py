"""SamplingParams: vLLM defaults, normalisation, and a clear ValueError for every bad value."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest

from loraserve.sampling_params import MAX_LOGPROBS, SamplingParams, SamplingType

VLLM_DEFAULTS: dict[str, Any] = {
    "n": 1,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "repetition_penalty": 1.0,
    "temperature": 1.0,
    "top_p": 1.0,
    "top_k": -1,
    "min_p": 0.0,
    "seed": None,
    "include_stop_str_in_output": False,
    "ignore_eos": False,
    "max_tokens": 16,
    "min_tokens": 0,
    "logprobs": None,
    "prompt_logprobs": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "detokenize": True,
}


def test_defaults_match_vllm() -> None:
    params = SamplingParams()
    for name, value in VLLM_DEFAULTS.items():
        assert getattr(params, name) == value, name
    assert params.stop == [] and params.stop_token_ids == []
    assert params.best_of == 1
    assert params.sampling_type == SamplingType.RANDOM and not params.is_greedy
    assert {f.name for f in fields(SamplingParams)} >= set(VLLM_DEFAULTS) | {
        "stop",
        "stop_token_ids",
        "best_of",
    }


def test_stop_is_normalised_to_a_list() -> None:
    assert SamplingParams(stop="###").stop == ["###"]
    assert SamplingParams(stop=("a", "b")).stop == ["a", "b"]  # type: ignore[arg-type]
    assert SamplingParams(stop_token_ids=(3, 4)).stop_token_ids == [3, 4]  # type: ignore[arg-type]


def test_sampling_type_and_greedy_reset() -> None:
    greedy = SamplingParams(temperature=0.0, top_p=0.5, top_k=3, min_p=0.2)
    assert greedy.is_greedy and greedy.sampling_type == SamplingType.GREEDY
    assert (greedy.top_p, greedy.top_k, greedy.min_p) == (1.0, -1, 0.0)
    assert SamplingParams(temperature=5e-6).is_greedy
    assert SamplingParams(temperature=0.7, seed=3).sampling_type == SamplingType.RANDOM_SEED
    assert SamplingParams(seed=-1).seed is None
    assert SamplingParams(top_k=0).top_k == 0


def test_max_tokens_none_and_limits_accepted() -> None:
    params = SamplingParams(max_tokens=None, min_tokens=100)
    assert params.max_tokens is None
    SamplingParams(
        logprobs=MAX_LOGPROBS, prompt_logprobs=0, n=128, presence_penalty=-2.0, frequency_penalty=2.0
    )
    SamplingParams(top_p=1.0, min_p=1.0, min_tokens=16, max_tokens=16)


def test_output_text_buffer_length() -> None:
    assert SamplingParams(stop=["ab", "abcd"]).output_text_buffer_length == 3
    assert SamplingParams(stop=["abcd"], include_stop_str_in_output=True).output_text_buffer_length == 0
    assert SamplingParams().output_text_buffer_length == 0


def test_clone_is_deep_and_independent() -> None:
    params = SamplingParams(stop=["x"], stop_token_ids=[5], max_tokens=None, seed=7)
    copy = params.clone()
    assert copy == params and copy is not params
    copy.stop.append("y")  # type: ignore[union-attr]
    copy.max_tokens = 12
    assert params.stop == ["x"] and params.max_tokens is None


@pytest.mark.parametrize(
    ("kwargs", "field", "value"),
    [
        ({"n": 0}, "n", "0"),
        ({"n": 129}, "n", "129"),
        ({"n": 1.5}, "n", "1.5"),
        ({"n": 3, "best_of": 2}, "best_of", "2"),
        ({"temperature": -0.1}, "temperature", "-0.1"),
        ({"top_p": 0.0}, "top_p", "0.0"),
        ({"top_p": 1.01}, "top_p", "1.01"),
        ({"top_k": -2}, "top_k", "-2"),
        ({"min_p": -0.01}, "min_p", "-0.01"),
        ({"min_p": 1.5}, "min_p", "1.5"),
        ({"presence_penalty": 2.5}, "presence_penalty", "2.5"),
        ({"presence_penalty": -2.01}, "presence_penalty", "-2.01"),
        ({"frequency_penalty": -3.0}, "frequency_penalty", "-3.0"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty", "nan"),
        ({"repetition_penalty": 0.0}, "repetition_penalty", "0.0"),
        ({"repetition_penalty": -1.0}, "repetition_penalty", "-1.0"),
        ({"max_tokens": 0}, "max_tokens", "0"),
        ({"min_tokens": -1}, "min_tokens", "-1"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens", "20"),
        ({"logprobs": -1}, "logprobs", "-1"),
        ({"prompt_logprobs": -3}, "prompt_logprobs", "-3"),
        ({"stop_token_ids": [3, -1]}, "stop_token_ids", "-1"),
        ({"stop": ["ok", ""]}, "stop", "''"),
        ({"stop": ""}, "stop", "''"),
        ({"stop": ["x"], "detokenize": False}, "detokenize", "stop"),
    ],
)
def test_bad_values_raise_naming_field_and_value(kwargs: dict[str, Any], field: str, value: str) -> None:
    with pytest.raises(ValueError) as info:
        SamplingParams(**kwargs)
    message = str(info.value)
    assert field in message and value in message, message


def test_too_large_messages_say_so() -> None:
    too_large: list[dict[str, Any]] = [{"n": 500}, {"best_of": 500}]
    for kwargs in too_large:
        with pytest.raises(ValueError, match="too large"):
            SamplingParams(**kwargs)
