"""Tokenizer loading, the model's end-of-sequence ids, prompt normalisation (text, {"prompt"},
{"prompt_token_ids"}) with validation, and `tokens_at_least`: a text's token count bounded from
below in pieces, stopping once it is too long, so a huge text is refused without tokenizing it all."""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any

from loraserve.config import ModelConfig
from loraserve.errors import PromptTooLongError

PromptInput = str | list[int] | dict[str, Any]
_RUN_START = re.compile(r"\S\s")  # a whitespace run starts after its match's first character
PROBE_CHUNK_CHARS = 8192
# A piece tokenized alone can give a token or two more than inside the whole text (a word-start
# marker added to it); pieces are cut where pre-tokenizers split anyway: before a whitespace run.
BOUNDARY_SLACK_TOKENS = 4
_UNKNOWN_LONGEST = 64


def load_tokenizer(model_config: ModelConfig) -> Any:
    """The model's tokenizer; None with skip_tokenizer_init (token-id prompts only, no output text)."""
    if model_config.skip_tokenizer_init:
        return None
    from transformers import AutoTokenizer

    # From the model's own folder, the config already parsed (with the fixes transformers needs, e.g.
    # Phi-3's "su" rope) saves transformers parsing config.json again.
    own = (
        {"config": model_config.hf_config} if model_config.tokenizer in ("", model_config.model_path) else {}
    )
    try:
        return AutoTokenizer.from_pretrained(
            model_config.tokenizer or model_config.model_path,
            trust_remote_code=model_config.trust_remote_code,
            use_fast=model_config.tokenizer_mode != "slow",
            revision=model_config.tokenizer_revision,
            **own,
        )
    except (OSError, ValueError) as exc:
        raise ValueError(
            f"Could not load a tokenizer from {model_config.tokenizer or model_config.model_path!r}: {exc}"
        ) from exc


@dataclass(frozen=True, slots=True)
class EndOfSequenceIds:
    """The tokenizer's end-of-sequence id and the other ids the model ends a turn with."""

    eos_token_id: int | None
    # Chat models often end turns with more tokens than the tokenizer's eos (e.g. <|eot_id|>); they
    # become stop tokens of every request that does not ignore eos.
    extra_eos_ids: tuple[int, ...]


def end_of_sequence_ids(tokenizer: Any, model_config: ModelConfig) -> EndOfSequenceIds:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(model_config.hf_config, "eos_token_id", None)
    eos_token_id = eos[0] if isinstance(eos, list) else eos
    return EndOfSequenceIds(eos_token_id, tuple(sorted(_generation_eos_ids(model_config) - {eos_token_id})))


def _generation_eos_ids(model_config: ModelConfig) -> set[int]:
    """Every end-of-sequence id that the model's generation_config.json and config declare."""
    ids: set[int] = set()
    sources: list[Any] = [getattr(model_config.hf_config, "eos_token_id", None)]
    try:
        from transformers import GenerationConfig

        sources.append(GenerationConfig.from_pretrained(model_config.model_path).eos_token_id)
    except (OSError, ValueError):
        pass  # no generation_config.json: the config's ids are all there is
    for value in sources:
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, (list, tuple)):
            ids.update(v for v in value if isinstance(v, int))
    return ids


def max_chars_per_token(tokenizer: Any) -> int:
    """The most characters of a text one token can cover: its longest vocabulary entry (byte-level
    BPE and SentencePiece entries are at least as long as the text they match), 4x that when the
    tokenizer normalizes its input (a normalizer may drop or merge characters)."""
    try:
        longest = max((len(token) for token in tokenizer.get_vocab()), default=1)
    except (AttributeError, NotImplementedError, TypeError):
        longest = _UNKNOWN_LONGEST
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizes = backend is None or backend.normalizer is not None
    return max(longest, 1) * (4 if normalizes else 1)


def tokens_at_least(
    tokenizer: Any,
    text: str,
    limit: int,
    chars_per_token: int,
    chunk_chars: int = PROBE_CHUNK_CHARS,
) -> tuple[int, int]:
    """(a lower bound on the text's token count, the characters tokenized to find it), stopping once
    the bound reaches `limit`: the work is about `limit` tokens' worth, whatever the text's length.

    The text is cut before whitespace runs (where pre-tokenizers split) into pieces of about
    `chunk_chars`; each piece is tokenized without special tokens, less `BOUNDARY_SLACK_TOKENS` per
    cut. A run without whitespace longer than a piece is not tokenized: it needs at least its length
    over `chars_per_token` (`max_chars_per_token`) tokens."""
    bound = tokenized = start = 0
    while start < len(text) and bound < limit:
        end = _cut(text, start, chunk_chars)
        if end - start > chunk_chars:  # one long run without whitespace: its length bounds it
            bound += -(-(end - start) // chars_per_token)
        else:
            tokens = len(tokenizer.encode(text[start:end], add_special_tokens=False))
            bound += max(tokens - (BOUNDARY_SLACK_TOKENS if start else 0), 0)
            tokenized += end - start
        start = end
    return bound, tokenized


def _cut(text: str, start: int, chunk_chars: int) -> int:
    """Where the piece from `start` ends: at the last start of a whitespace run within `chunk_chars`,
    else at the first one after it, else at the text's end."""
    end = start + chunk_chars
    if end >= len(text):
        return len(text)
    for i in range(end, start, -1):
        if text[i].isspace() and not text[i - 1].isspace():
            return i
    match = _RUN_START.search(text, end)
    return match.start() + 1 if match is not None else len(text)


def prepare_prompt(
    prompt: PromptInput, tokenizer: Any, model_config: ModelConfig
) -> tuple[str | None, list[int]]:
    """Return (prompt text or None, token ids), raising ValueError for anything unusable."""
    text: str | None = None
    if isinstance(prompt, dict):
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
        elif "prompt" in prompt:
            text = prompt["prompt"]
            ids = None
        else:
            raise ValueError("A prompt dict needs a 'prompt' or a 'prompt_token_ids' key.")
    elif isinstance(prompt, str):
        text, ids = prompt, None
    elif isinstance(prompt, (list, tuple)):
        ids = list(prompt)
    else:
        raise ValueError(
            f"Unsupported prompt type {type(prompt).__name__}; use a str or a list of token ids."
        )
    if ids is None:
        if not isinstance(text, str):
            raise ValueError("'prompt' must be a string.")
        if tokenizer is None:
            raise ValueError(
                "This engine was started with skip_tokenizer_init, so it has no tokenizer: text prompts cannot be "
                "tokenized; pass token ids (prompt_token_ids)."
            )
        ids = tokenizer.encode(text)
    ids = _validate_ids(ids, model_config)
    return text, ids


def _validate_ids(ids: Any, model_config: ModelConfig) -> list[int]:
    if not isinstance(ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError("prompt_token_ids must be a list of integers.")
    if not ids:
        raise ValueError("The prompt is empty; at least one token is needed.")
    vocab = model_config.vocab_size
    bad = [t for t in ids if t < 0 or t >= vocab]
    if bad:
        raise ValueError(f"Token id {bad[0]} is out of vocabulary (valid ids are 0..{vocab - 1}).")
    if len(ids) >= model_config.max_model_len:
        raise PromptTooLongError(
            f"The prompt has {len(ids)} tokens, but max_model_len is {model_config.max_model_len}; "
            f"the prompt plus at least one generated token must fit."
        )
    return ids
