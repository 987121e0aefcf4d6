"""vLLM's per-request token controls as values: `logit_bias`, `allowed_token_ids`, `bad_words`.

What `SamplingParams` checks and stores for them, with vLLM's semantics and error texts: biases keyed
by token id, the allowed list, and bad words tokenized into token-id sequences the way vLLM's
`SamplingParams.update_from_tokenizer` does. A bad word's last token is banned whenever the output
ends with the tokens before it; `BadWordsTable` indexes the sequences by that prefix so the sampler
looks up one tuple per distinct prefix length and row, however many words a request bans.
The sampler applies them (`engine/token_controls.py`); no torch here.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

# prefix length -> (the output's last `length` tokens -> the token ids banned after them)
BadWordsTable = dict[int, dict[tuple[int, ...], list[int]]]


class SamplingParamsError(ValueError):
    """A ValueError about one request field (vLLM's VLLMValidationError `parameter`): the serving layer
    answers it with a 400 whose `param` names that field."""

    def __init__(self, message: str, parameter: str) -> None:
        super().__init__(message)
        self.parameter = parameter


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def normalize_logit_bias(logit_bias: Any) -> dict[int, float] | None:
    """Token id -> finite float bias; string keys ("5", as JSON sends them) become ids as in vLLM."""
    if logit_bias is None:
        return None
    if not isinstance(logit_bias, dict):
        raise SamplingParamsError(
            f"logit_bias must be a dict of token id -> bias, got {type(logit_bias).__name__}.", "logit_bias"
        )
    result: dict[int, float] = {}
    invalid_keys = []
    for key, bias in logit_bias.items():
        try:  # int(" 5") is 5, as in vLLM; a float or a bool is not a token id
            token_id = key if _is_int(key) else int(key) if isinstance(key, str) else None
        except ValueError:
            token_id = None
        if token_id is None:
            invalid_keys.append(key)
            continue
        if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not math.isfinite(bias):
            # NaN or +-inf would turn a whole row of probabilities into NaN.
            raise SamplingParamsError(
                f"logit_bias values must be finite numbers, got {bias!r} for token id {token_id}.",
                "logit_bias",
            )
        result[token_id] = float(bias)
    if invalid_keys:  # vLLM's text
        raise SamplingParamsError(
            f"logit_bias contains key(s) that cannot be converted to integer token IDs: {invalid_keys!r}",
            "logit_bias",
        )
    return result or None


def normalize_allowed_token_ids(allowed: Any) -> list[int] | None:
    if allowed is None:
        return None
    if isinstance(allowed, (str, bytes)) or not isinstance(allowed, Iterable):
        raise SamplingParamsError(
            f"allowed_token_ids must be a list of integers, got {allowed!r}.", "allowed_token_ids"
        )
    ids = list(allowed)
    if not ids:  # vLLM's text
        raise SamplingParamsError("allowed_token_ids is not None and empty!", "allowed_token_ids")
    if not all(_is_int(t) for t in ids):
        raise SamplingParamsError(
            f"allowed_token_ids must be a list of integers, got {ids!r}.", "allowed_token_ids"
        )
    return list(dict.fromkeys(ids))


def check_bad_words(bad_words: Any) -> list[str] | None:
    """A list of distinct non-blank words (one string is one word)."""
    if bad_words is None:
        return None
    words = [bad_words] if isinstance(bad_words, str) else bad_words
    if not isinstance(words, Iterable):
        raise SamplingParamsError(f"bad_words must be a list of strings, got {bad_words!r}.", "bad_words")
    words = list(dict.fromkeys(words))
    for word in words:
        if not isinstance(word, str):
            raise SamplingParamsError(f"bad_words must be a list of strings, got {word!r}.", "bad_words")
        if not word.strip():  # it has no tokens to ban (vLLM fails on it with an IndexError)
            raise SamplingParamsError(
                f"bad_words cannot contain an empty or blank string, got bad_words={words!r}.", "bad_words"
            )
        try:
            word.encode("utf-8")
        except UnicodeEncodeError as exc:  # lone surrogates are valid JSON, but no tokenizer takes them
            raise SamplingParamsError(
                f"bad_words must be valid Unicode text: {exc.reason} at position {exc.start} of {word!r}.",
                "bad_words",
            ) from exc
    return words or None


def check_bad_words_token_ids(sequences: Any) -> list[list[int]]:
    result = []
    for sequence in sequences:
        ids = list(sequence) if isinstance(sequence, (list, tuple)) else None
        if not ids or not all(_is_int(t) for t in ids):
            raise SamplingParamsError(
                f"bad_words_token_ids must be non-empty lists of integers, got {sequence!r}.", "bad_words"
            )
        result.append(ids)
    return result


def tokenize_bad_words(bad_words: list[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's sequences: each word (left-stripped) alone, then after a space when that gives another
    first token and as many tokens (a word token of its own, as in the middle of a text)."""
    sequences: list[list[int]] = []
    for word in bad_words:
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        if not plain:
            raise SamplingParamsError(f"The bad word {word!r} has no tokens.", "bad_words")
        sequences.append(plain)
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        if spaced and spaced[0] != plain[0] and len(spaced) == len(plain):
            sequences.append(spaced)
    return sequences


def bad_words_table(sequences: list[list[int]]) -> BadWordsTable | None:
    table: BadWordsTable = {}
    for sequence in sequences:
        banned = table.setdefault(len(sequence) - 1, {}).setdefault(tuple(sequence[:-1]), [])
        if sequence[-1] not in banned:
            banned.append(sequence[-1])
    return table or None


def banned_after(table: BadWordsTable, output_token_ids: list[int]) -> Iterable[int]:
    """The tokens a row may not sample next: the last token of every bad word whose other tokens end
    the output (vLLM: the generated tokens only, never the prompt)."""
    num_output = len(output_token_ids)
    for length, by_prefix in table.items():
        if length > num_output:
            continue
        prefix = tuple(output_token_ids[num_output - length :]) if length else ()
        yield from by_prefix.get(prefix, ())


def check_token_ids(
    logit_bias: dict[int, float] | None,
    allowed_token_ids: list[int] | None,
    bad_words_token_ids: list[list[int]] | None,
    vocab_size: int,
    tokenizer_size: int | None,
) -> None:
    """vLLM's out-of-vocabulary checks, with its texts."""
    if logit_bias:
        invalid = [t for t in logit_bias if t < 0 or t >= vocab_size]
        if invalid:
            raise SamplingParamsError(
                f"token_id(s) {invalid} in logit_bias contain out-of-vocab token ids. Vocabulary size: {vocab_size}",
                "logit_bias",
            )
    if allowed_token_ids is not None:
        # vLLM checks against the tokenizer; a token past the model's logits is never sampled either.
        limit = vocab_size if tokenizer_size is None else min(vocab_size, tokenizer_size)
        if any(t < 0 or t >= limit for t in allowed_token_ids):
            raise SamplingParamsError(
                "allowed_token_ids contains out-of-vocab token id!", "allowed_token_ids"
            )
    if bad_words_token_ids:
        invalid = [t for ids in bad_words_token_ids for t in ids if t < 0 or t >= vocab_size]
        if invalid:
            raise SamplingParamsError(
                f"The model vocabulary size is {vocab_size}, but the following tokens were specified as bad: "
                f"{invalid}. All token id values should be integers satisfying: 0 <= token_id <= {vocab_size - 1}.",
                "bad_words",
            )
