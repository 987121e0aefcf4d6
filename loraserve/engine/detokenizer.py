"""Incremental detokenization of one sequence, stop-string matching and logprob token texts.

Each step decodes only a small window of ids (vLLM's prefix..read offsets): the text of the window
before the new token is compared with the text including it, and the difference is the new delta. Text is held
back while it ends in U+FFFD, i.e. while a byte-fallback piece is still waiting for the rest of its
UTF-8 character. The prefix window exists because decoders such as SentencePiece's treat the first
token of a decode specially (leading space), so both decodes must start at the same token.
"""

from __future__ import annotations

from dataclasses import InitVar, dataclass, field
from functools import lru_cache
from typing import Any

from loraserve.outputs import Logprob

# Prompt tokens used as decoding context for the first generated token, as in vLLM.
_INITIAL_CONTEXT_TOKENS = 5
_REPLACEMENT_CHAR = "\ufffd"


@lru_cache(maxsize=16)
def _special_ids(tokenizer: Any) -> frozenset[int]:
    """Ids that `skip_special_tokens` removes, exactly as the tokenizer's own decode decides."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:  # the Rust decode skips the added tokens flagged special
        return frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    return frozenset(getattr(tokenizer, "all_special_ids", None) or [])


@lru_cache(maxsize=16)
def _added_ids(tokenizer: Any) -> frozenset[int]:
    return frozenset(int(i) for i in (getattr(tokenizer, "added_tokens_decoder", None) or {}))


@dataclass(slots=True)
class IncrementalDetokenizer:
    """Turns a stream of generated token ids into text deltas that join to the sequence's text."""

    tokenizer: Any
    prompt_token_ids: InitVar[list[int]]
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    output_text: str = field(default="", init=False)
    # The decode window: window_ids[:read_offset] were already emitted (vLLM's prefix..read span) and
    # only give the decoder its context; the rest waits for a complete character.
    window_ids: list[int] = field(default_factory=list, init=False)
    read_offset: int = field(default=0, init=False)
    _backend: Any = field(default=None, init=False, repr=False)
    _is_slow_with_added: bool = field(default=False, init=False, repr=False)
    _skipped_ids: frozenset[int] = field(default=frozenset(), init=False, repr=False)

    def __post_init__(self, prompt_token_ids: list[int]) -> None:
        # Fast tokenizers decode in Rust; spaces_between_special_tokens does not apply to them (HF, vLLM).
        self._backend = getattr(self.tokenizer, "backend_tokenizer", None)
        self._is_slow_with_added = self._backend is None and bool(_added_ids(self.tokenizer))
        if self.skip_special_tokens:
            self._skipped_ids = _special_ids(self.tokenizer)
        context = [t for t in prompt_token_ids if t not in self._skipped_ids][-_INITIAL_CONTEXT_TOKENS:]
        self.window_ids = context
        self.read_offset = len(context)

    def append(self, token_id: int) -> str:
        """Add one generated token; returns the text it completes ("" while a character is incomplete)."""
        if token_id in self._skipped_ids:
            return ""  # decodes to nothing; keeping it out of the window keeps the window small
        self.window_ids.append(token_id)
        prefix_text = self._decode(self.window_ids[: self.read_offset])
        new_text = self._decode(self.window_ids)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return ""
        delta = new_text[len(prefix_text) :]
        # The emitted ids become the next prefix; older ones are dropped so every decode stays small.
        del self.window_ids[: self.read_offset]
        self.read_offset = len(self.window_ids)
        self.output_text += delta
        return delta

    def truncate(self, length: int) -> None:
        """Cut output_text to `length` characters (after a stop string matched)."""
        self.output_text = self.output_text[:length]

    def _decode(self, ids: list[int]) -> str:
        if not ids:
            return ""
        if self._backend is not None:
            return self._backend.decode(ids, skip_special_tokens=self.skip_special_tokens)
        if not self._is_slow_with_added:
            return self.tokenizer.decode(
                ids, skip_special_tokens=self.skip_special_tokens, clean_up_tokenization_spaces=False
            )
        return self._decode_slow_with_added(ids)

    def _decode_slow_with_added(self, ids: list[int]) -> str:
        """Slow tokenizers: added tokens are kept verbatim and optionally separated by spaces (as in HF v4)."""
        added = _added_ids(self.tokenizer)
        pieces: list[str] = []
        run: list[int] = []
        for token_id in ids:
            if token_id not in added:
                run.append(token_id)
                continue
            if run:
                pieces.append(
                    self.tokenizer.convert_tokens_to_string(self.tokenizer.convert_ids_to_tokens(run))
                )
                run = []
            pieces.append(self.tokenizer.convert_ids_to_tokens(token_id))
        if run:
            pieces.append(self.tokenizer.convert_tokens_to_string(self.tokenizer.convert_ids_to_tokens(run)))
        return (" " if self.spaces_between_special_tokens else "").join(pieces)


def find_stop_string(
    text: str, new_delta_len: int, stops: list[str], include_stop_str_in_output: bool
) -> tuple[str | None, int]:
    """Which stop string first occurs in `text` ending inside its last `new_delta_len` characters.

    Returns (stop string or None, length of text to keep). Earlier text was searched in earlier steps,
    so only the tail that can hold a new match is scanned. The earliest match in the text wins.
    """
    if new_delta_len <= 0 or not stops:
        return None, len(text)
    best_stop: str | None = None
    best_index = len(text)
    for stop in stops:
        start = max(0, len(text) - new_delta_len - len(stop) + 1)
        index = text.find(stop, start)
        if index != -1 and index < best_index:
            best_stop, best_index = stop, index
    if best_stop is None:
        return None, len(text)
    if include_stop_str_in_output:
        return best_stop, best_index + len(best_stop)
    return best_stop, best_index


def decode_token_texts(tokenizer: Any, token_ids: list[int]) -> list[str]:
    """Each id decoded on its own, the text vLLM reports for a logprob entry."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return list(backend.decode_batch([[t] for t in token_ids], skip_special_tokens=False))
    return [tokenizer.decode([t]) or "" for t in token_ids]


def fill_decoded_tokens(tokenizer: Any, position_logprobs: list[dict[int, Logprob]]) -> None:
    """Set `decoded_token` on every Logprob, decoding each distinct id once."""
    distinct = list({token_id for entry in position_logprobs for token_id in entry})
    texts = dict(zip(distinct, decode_token_texts(tokenizer, distinct), strict=True))
    for entry in position_logprobs:
        for token_id, logprob in entry.items():
            logprob.decoded_token = texts[token_id]
