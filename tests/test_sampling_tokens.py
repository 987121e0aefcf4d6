"""SamplingParams' token controls: normalisation, vLLM's validation texts, bad-word tokenization."""

from __future__ import annotations

from typing import Any

import pytest

from loraserve.sampling_params import SamplingParams
from loraserve.sampling_tokens import SamplingParamsError, banned_after, tokenize_bad_words


class WordTokenizer:
    """Encodes from a fixed table, to pin down vLLM's rule for the leading-space variant."""

    def __init__(self, table: dict[str, list[int]]) -> None:
        self.table = table
        self.calls: list[tuple[str, bool]] = []

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        self.calls.append((text, add_special_tokens))
        return self.table[text]


def test_bad_words_are_tokenized_alone_and_after_a_space_as_vllm_does() -> None:
    tokenizer = WordTokenizer(
        {
            "hello": [1, 2],
            " hello": [3, 2],  # another first token, same length: a word token of its own, kept
            "world": [4],
            " world": [5, 6],  # another length: dropped
            "same": [7, 8],
            " same": [7, 9],  # the same first token: dropped
        }
    )
    assert tokenize_bad_words(["hello", "  world", "same"], tokenizer) == [[1, 2], [3, 2], [4], [7, 8]]
    assert all(not special for _, special in tokenizer.calls)  # no BOS in a bad word
    params = SamplingParams(bad_words=["hello", "hello", "world"])
    assert params.bad_words == ["hello", "world"]  # distinct, as vLLM's
    assert not params.has_token_controls  # nothing to apply before tokenization
    params.update_from_tokenizer(tokenizer)
    assert params.bad_words_token_ids == [[1, 2], [3, 2], [4]]
    assert params.has_token_controls and params.bad_words_prefix_len == 1
    assert params.clone().bad_words_table == params.bad_words_table


def test_banned_after_reads_the_output_suffix() -> None:
    params = SamplingParams(bad_words_token_ids=[[9], [1, 2, 3], [2, 4], [1, 2, 5]])
    table = params.bad_words_table
    assert table is not None and params.bad_words_prefix_len == 2
    assert sorted(banned_after(table, [])) == [9]
    assert sorted(banned_after(table, [7, 1, 2])) == [3, 4, 5, 9]
    assert sorted(banned_after(table, [1, 2, 7])) == [9]
    assert sorted(banned_after(table, [2])) == [4, 9]


def test_logit_bias_keys_become_token_ids() -> None:
    params = SamplingParams(logit_bias={"5": 1, 7: -2.5, " 8": 3})
    assert params.logit_bias == {5: 1.0, 7: -2.5, 8: 3.0} and params.has_token_controls
    assert SamplingParams(logit_bias={}).logit_bias is None
    assert not SamplingParams().has_token_controls


@pytest.mark.parametrize(
    ("kwargs", "parameter", "message"),
    [
        (
            {"logit_bias": {"x": 1, 1.5: 2}},
            "logit_bias",
            "logit_bias contains key(s) that cannot be converted to integer token IDs: ['x', 1.5]",
        ),
        ({"logit_bias": {1: float("nan")}}, "logit_bias", "logit_bias values must be finite numbers"),
        ({"logit_bias": {1: float("inf")}}, "logit_bias", "logit_bias values must be finite numbers"),
        ({"logit_bias": [1, 2]}, "logit_bias", "logit_bias must be a dict"),
        ({"allowed_token_ids": []}, "allowed_token_ids", "allowed_token_ids is not None and empty!"),
        (
            {"allowed_token_ids": [1, "2"]},
            "allowed_token_ids",
            "allowed_token_ids must be a list of integers",
        ),
        ({"allowed_token_ids": [True]}, "allowed_token_ids", "allowed_token_ids must be a list of integers"),
        ({"bad_words": ["ok", " "]}, "bad_words", "bad_words cannot contain an empty or blank string"),
        ({"bad_words": [3]}, "bad_words", "bad_words must be a list of strings"),
        ({"bad_words": ["ok", "\ud800"]}, "bad_words", "bad_words must be valid Unicode text"),
        (
            {"bad_words_token_ids": [[]]},
            "bad_words",
            "bad_words_token_ids must be non-empty lists of integers",
        ),
    ],
)
def test_bad_values_name_their_field(kwargs: dict[str, Any], parameter: str, message: str) -> None:
    with pytest.raises(SamplingParamsError) as caught:
        SamplingParams(**kwargs)
    assert caught.value.parameter == parameter and str(caught.value).startswith(message)


@pytest.mark.parametrize(
    ("kwargs", "parameter", "message"),
    [
        (
            {"logit_bias": {3: 1.0, 64: 1.0, -1: 2.0}},
            "logit_bias",
            "token_id(s) [64, -1] in logit_bias contain out-of-vocab token ids. Vocabulary size: 64",
        ),
        (
            {"allowed_token_ids": [0, 64]},
            "allowed_token_ids",
            "allowed_token_ids contains out-of-vocab token id!",
        ),
        (
            {"allowed_token_ids": [-1]},
            "allowed_token_ids",
            "allowed_token_ids contains out-of-vocab token id!",
        ),
        (
            {"bad_words_token_ids": [[1, 70]]},
            "bad_words",
            "The model vocabulary size is 64, but the following tokens were specified as bad: [70]. All token "
            "id values should be integers satisfying: 0 <= token_id <= 63.",
        ),
        ({"bad_words": ["no"]}, "bad_words", "bad_words need a tokenizer"),
    ],
)
def test_vocabulary_checks_use_vllms_texts(kwargs: dict[str, Any], parameter: str, message: str) -> None:
    params = SamplingParams(**kwargs)
    with pytest.raises(SamplingParamsError) as caught:
        params.verify_token_ids(64)
    assert caught.value.parameter == parameter and str(caught.value).startswith(message)


def test_allowed_token_ids_are_checked_against_the_tokenizer_too() -> None:
    params = SamplingParams(allowed_token_ids=[50])
    params.verify_token_ids(64)
    with pytest.raises(SamplingParamsError, match="out-of-vocab"):
        params.verify_token_ids(64, tokenizer_size=50)
