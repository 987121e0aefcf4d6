"""tokens_at_least: a lower bound on a text's token count from bounded pieces, never above the real
count (so no text that fits is refused), and the work stops near the limit whatever the length."""

from __future__ import annotations

import random
from typing import Any

import pytest

from loraserve.engine.tokenization import max_chars_per_token, tokens_at_least


def _metaspace_tokenizer() -> Any:
    """A SentencePiece-style tokenizer (Metaspace: a word-start marker on every piece)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    tok.train_from_iterator(_texts(), trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>"]))
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def _texts() -> list[str]:
    rng = random.Random(7)
    words = ["the", "adapter", "serves", "tokens", "é", "日本", "  ", "\n", "\t", "x" * 40, "--", "!?"]
    mixed = "".join(rng.choice(words) + rng.choice([" ", "", "  ", "\n"]) for _ in range(3000))
    return [mixed, "a" * 5000, ("word " * 900), "no_whitespace_" * 400, " \n " * 900, "ab  cd   ef    " * 300]


@pytest.fixture(scope="module", params=["byte-level", "metaspace"])
def any_tokenizer(request: pytest.FixtureRequest, tokenizer: Any) -> Any:
    return tokenizer if request.param == "byte-level" else _metaspace_tokenizer()


@pytest.mark.parametrize("chunk_chars", [64, 257, 8192])
def test_the_bound_never_exceeds_the_real_count(any_tokenizer: Any, chunk_chars: int) -> None:
    for text in _texts():
        real = len(any_tokenizer.encode(text, add_special_tokens=False))
        per_token = max_chars_per_token(any_tokenizer)
        bound, probed = tokens_at_least(any_tokenizer, text, 10**9, per_token, chunk_chars=chunk_chars)
        assert bound <= real, (text[:40], bound, real)
        assert probed <= len(text)
        if chunk_chars == 8192 and len(text) <= 8192:
            assert bound == real and probed == len(text)  # one piece: the exact count


class _CountingTokenizer:
    """Counts the characters it is asked to tokenize."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chars = 0

    def encode(self, text: str, **kwargs: Any) -> list[int]:
        self.chars += len(text)
        return list(self.inner.encode(text, **kwargs))


def test_a_huge_text_is_counted_only_until_it_cannot_fit(tokenizer: Any) -> None:
    counting = _CountingTokenizer(tokenizer)
    text = "The adapter serves tokens to every client in turn. " * 25_000  # 1.3 M characters
    bound, probed = tokens_at_least(counting, text, 2048, max_chars_per_token(tokenizer), chunk_chars=8192)
    assert bound >= 2048
    assert probed == counting.chars < 3 * 2048 * 8  # a few pieces, not the 1.3 M characters
    assert counting.chars < len(text) // 50


def test_a_huge_text_without_whitespace_is_bounded_by_its_length_untokenized(tokenizer: Any) -> None:
    counting = _CountingTokenizer(tokenizer)
    per_token = max_chars_per_token(tokenizer)
    text = "a" * (per_token * 3000)
    bound, probed = tokens_at_least(counting, text, 2048, per_token)
    assert bound >= 2048 and probed == counting.chars == 0


def test_max_chars_per_token_is_the_longest_entry_without_a_normalizer(tokenizer: Any) -> None:
    longest = max(len(token) for token in tokenizer.get_vocab())
    assert tokenizer.backend_tokenizer.normalizer is None
    assert max_chars_per_token(tokenizer) == longest
