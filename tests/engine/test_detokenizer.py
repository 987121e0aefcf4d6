"""Incremental detokenizer and stop strings, against the tokenizer's own full decode."""

from __future__ import annotations

import random
from typing import Any

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizer, PreTrainedTokenizerFast

from loraserve.engine.detokenizer import (
    IncrementalDetokenizer,
    decode_token_texts,
    fill_decoded_tokens,
    find_stop_string,
)
from loraserve.outputs import Logprob

SENTENCES = [
    "héllo wörld 你好 🙂",
    "the quick brown fox jumps over the lazy dog",
    "naïve café, déjà vu in 東京 🙂🚀",
    "hello hello world! 你好世界",
    "Ünïcödé straße 😀 emoji ok",
]
WORDS = [
    "héllo",
    "wörld",
    "你好",
    "🙂",
    "the",
    "quick",
    "brown",
    "fox",
    "naïve",
    "café",
    "東京",
    "🚀",
    "😀",
    "straße",
    "a",
    "b",
    ",",
    "!",
    "\n",
]


@pytest.fixture(scope="module")
def tokenizer() -> PreTrainedTokenizerFast:
    model = Tokenizer(models.BPE())
    model.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    model.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=330,  # few merges: most multi-byte characters stay split over several tokens
        special_tokens=["<eos>", "<pad>", "<|tool|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    model.train_from_iterator(SENTENCES * 10, trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=model, eos_token="<eos>", pad_token="<pad>", clean_up_tokenization_spaces=False
    )


def encode(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def decode(tokenizer: Any, ids: list[int], skip_special_tokens: bool = False) -> str:
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert isinstance(text, str)
    return text


def random_text(rng: random.Random) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randrange(1, 12)))


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> list[str]:
    return [detok.append(token_id) for token_id in ids]


def test_tokenizer_really_splits_characters(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, " ".join(WORDS))
    assert sum("\ufffd" in decode(tokenizer, [t]) for t in ids) >= 5


def test_deltas_join_to_full_decode(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(0)
    for _ in range(200):
        ids = encode(tokenizer, random_text(rng))
        detok = IncrementalDetokenizer(tokenizer, [])
        deltas = stream(detok, ids)
        assert "".join(deltas) == decode(tokenizer, ids) == detok.output_text
        assert not any(d.endswith("\ufffd") for d in deltas)


def test_deltas_after_prompt(tokenizer: PreTrainedTokenizerFast) -> None:
    rng = random.Random(1)
    checked = 0
    for _ in range(300):
        ids = encode(tokenizer, random_text(rng) + " " + random_text(rng))
        cut = rng.randrange(len(ids))
        prompt, output = ids[:cut], ids[cut:]
        prompt_text = decode(tokenizer, prompt)
        if "\ufffd" in prompt_text:
            continue  # the prompt ends inside a character: no clean split of the text exists
        checked += 1
        detok = IncrementalDetokenizer(tokenizer, prompt)
        assert "".join(stream(detok, output)) == decode(tokenizer, ids)[len(prompt_text) :]
    assert checked > 100


def test_multibyte_character_is_held_back_until_complete(tokenizer: PreTrainedTokenizerFast) -> None:
    byte_ids = [tokenizer.get_vocab()[b] for b in ("ð", "Ł", "Ļ", "Ĥ")]  # the 4 bytes of 🙂
    assert decode(tokenizer, byte_ids) == "🙂"
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "hi"))
    assert stream(detok, byte_ids) == ["", "", "", "🙂"]


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_random_ids_with_special_tokens(
    tokenizer: PreTrainedTokenizerFast, skip_special_tokens: bool
) -> None:
    rng = random.Random(2)
    vocab_size = len(tokenizer)
    exact = 0
    for _ in range(300):
        ids = [rng.randrange(vocab_size) for _ in range(rng.randrange(1, 40))]
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip_special_tokens)
        joined = "".join(stream(detok, ids))
        full = decode(tokenizer, ids, skip_special_tokens=skip_special_tokens)
        # Invalid byte sequences are emitted once a later token completes a character; whatever is
        # still pending at the end is held back, and is exactly the text that ends in U+FFFD.
        assert full.startswith(joined)
        held = full[len(joined) :]
        assert held == "" or held.endswith("\ufffd")
        exact += held == ""
    assert exact > 150


def test_window_stays_small(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, " ".join(SENTENCES * 40))
    detok = IncrementalDetokenizer(tokenizer, ids[:50])
    for token_id in ids:
        detok.append(token_id)
        assert len(detok.window_ids) <= 12  # decoding cost per step does not grow with the sequence
    assert detok.output_text == decode(tokenizer, ids)


def test_metaspace_leading_space_uses_prefix_window() -> None:
    vocab = {"<unk>": 0, "▁Hello": 1, "▁world": 2, "!": 3, "▁again": 4}
    model = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    model.pre_tokenizer = pre_tokenizers.Metaspace()
    model.decoder = decoders.Metaspace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=model, clean_up_tokenization_spaces=False)
    prompt, output = [1], [2, 3, 4]
    assert decode(tokenizer, output) == "world! again"  # the first token's space is dropped on its own
    detok = IncrementalDetokenizer(tokenizer, prompt)
    full = decode(tokenizer, prompt + output)
    assert stream(detok, output) == [" world", "!", " again"]
    assert detok.output_text == full[len(decode(tokenizer, prompt)) :]
    assert "".join(stream(IncrementalDetokenizer(tokenizer, []), output)) == decode(tokenizer, output)


class CharTokenizer(PreTrainedTokenizer):
    """A slow (pure Python) character tokenizer, to exercise the non-Rust decode path."""

    def __init__(self, chars: str, **kwargs: Any) -> None:
        self._vocab = {c: i for i, c in enumerate(chars)}
        self._inverse = {i: c for c, i in self._vocab.items()}
        super().__init__(**kwargs)

    @property
    def vocab_size(self) -> int:
        return len(self._vocab)

    def get_vocab(self) -> dict[str, int]:
        return dict(self._vocab, **self.added_tokens_encoder)

    def _tokenize(self, text: str, **kwargs: Any) -> list[str]:
        return list(text)

    def _convert_token_to_id(self, token: str) -> int:
        return self._vocab[token]

    def _convert_id_to_token(self, index: int) -> str:
        return self._inverse[index]

    def convert_tokens_to_string(self, tokens: list[str]) -> str:
        return "".join(tokens)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("spaces_between_special_tokens", [True, False])
def test_slow_tokenizer_added_tokens(skip_special_tokens: bool, spaces_between_special_tokens: bool) -> None:
    tokenizer = CharTokenizer("abc xyz", eos_token="</s>", additional_special_tokens=["<tool>"])
    ids = encode(tokenizer, "ab c</s>x<tool>yz")
    detok = IncrementalDetokenizer(
        tokenizer,
        encode(tokenizer, "za"),
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
    )
    joined = "".join(stream(detok, ids))
    if skip_special_tokens:
        assert joined == decode(tokenizer, ids, skip_special_tokens=True) == "ab cxyz"
    elif spaces_between_special_tokens:
        assert joined == "ab c </s> x <tool> yz"  # vLLM's (and HF v4's) slow-tokenizer spacing
    else:
        assert joined == decode(tokenizer, ids) == "ab c</s>x<tool>yz"


def naive_first_stop(text: str, stops: list[str]) -> tuple[str, int] | None:
    matches = [(text.find(s), i, s) for i, s in enumerate(stops) if s in text]
    if not matches:
        return None
    index, _, stop = min(matches)
    return stop, index


@pytest.mark.parametrize("include_stop_str_in_output", [False, True])
def test_stop_strings_across_token_boundaries(
    tokenizer: PreTrainedTokenizerFast, include_stop_str_in_output: bool
) -> None:
    rng = random.Random(3)
    found = 0
    for _ in range(200):
        text = " ".join(rng.choice(SENTENCES) for _ in range(3))
        start = rng.randrange(len(text) - 6)
        stops = [
            text[start : start + rng.randrange(1, 6)],
            "never there",
            text[rng.randrange(len(text)) :][:3],
        ]
        stops = [s for s in stops if s]
        detok = IncrementalDetokenizer(tokenizer, [])
        result = None
        for token_id in encode(tokenizer, text):
            delta = detok.append(token_id)
            stop, keep = find_stop_string(detok.output_text, len(delta), stops, include_stop_str_in_output)
            if stop is not None:
                result = (stop, keep)
                break
            assert keep == len(detok.output_text)
            assert naive_first_stop(detok.output_text, stops) is None  # no match was missed earlier
        expected = naive_first_stop(detok.output_text, stops)
        assert expected is not None and result is not None
        stop, index = expected
        assert result == (stop, index + len(stop) if include_stop_str_in_output else index)
        detok.truncate(result[1])
        kept = detok.output_text
        assert kept.endswith(stop) if include_stop_str_in_output else not any(s in kept for s in stops)
        found += 1
    assert found == 200


def test_find_stop_string_edge_cases() -> None:
    assert find_stop_string("abc", 0, ["abc"], False) == (None, 3)
    assert find_stop_string("abc", 3, [], False) == (None, 3)
    # Only the tail that can end in the new delta is searched: an older match was handled before.
    assert find_stop_string("xx stop yy", 2, ["stop"], False) == (None, 10)
    assert find_stop_string("xx stop", 2, ["stop"], False) == ("stop", 3)
    assert find_stop_string("xx stop", 1, ["stop"], True) == ("stop", 7)
    # The earliest match wins, whatever the order of the stop list.
    assert find_stop_string("abcdef", 6, ["def", "bc"], False) == ("bc", 1)


def test_decoded_token_texts(tokenizer: PreTrainedTokenizerFast) -> None:
    ids = encode(tokenizer, "héllo 🙂") + [tokenizer.eos_token_id]
    assert decode_token_texts(tokenizer, ids) == [decode(tokenizer, [t]) for t in ids]
    entries = [{t: Logprob(-1.0, 1)} for t in ids] + [{ids[0]: Logprob(-0.5, 1), ids[1]: Logprob(-2.0, 3)}]
    fill_decoded_tokens(tokenizer, entries)
    for entry in entries:
        for token_id, logprob in entry.items():
            assert logprob.decoded_token == decode(tokenizer, [token_id])
