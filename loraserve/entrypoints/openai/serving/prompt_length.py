"""PromptLengthGuard: whether a text can fit in max_model_len, decided before it is tokenized whole.

A text longer than max_model_len x `max_chars_per_token` characters cannot fit and is refused from its
length alone. A text longer than `probe_above_chars` is first counted in bounded pieces
(`tokens_at_least`, on the tokenizer pool), which stops once the count reaches max_model_len: a text
that cannot fit costs about max_model_len tokens' worth of work, however long it is. Both refusals use
vLLM's "This model's maximum context length is ..." text.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from http import HTTPStatus
from typing import Any

from loraserve.engine.tokenization import max_chars_per_token, tokens_at_least
from loraserve.entrypoints.openai.serving.errors import APIError

PROBE_ABOVE_CHARS = 8192
Runner = Callable[..., Awaitable[Any]]  # runs a function on the tokenizer pool


class PromptLengthGuard:
    def __init__(self, tokenizer: Any, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self._chars_per_token: int | None = None

    @property
    def chars_per_token(self) -> int:
        """The most characters one token of this vocabulary covers (read once)."""
        if self._chars_per_token is None:
            self._chars_per_token = max_chars_per_token(self.tokenizer)
        return self._chars_per_token

    @property
    def max_prompt_chars(self) -> int:
        """A text longer than this cannot fit in max_model_len tokens."""
        return self.max_model_len * self.chars_per_token

    @property
    def probe_above_chars(self) -> int:
        """Longer texts are counted in pieces before they are tokenized whole; shorter ones cost little
        and nearly always fit (few tokens cover more than 4 characters)."""
        return max(PROBE_ABOVE_CHARS, 4 * self.max_model_len)

    async def check(self, text: str, param: str, run: Runner) -> None:
        """400 unless `text` may fit; `run` puts the piece count on the tokenizer pool."""
        if len(text) > self.max_prompt_chars:
            raise self._too_long(f"has {len(text)} characters, more than that many tokens can hold", param)
        if len(text) <= self.probe_above_chars:
            return
        bound, probed = await run(
            tokens_at_least, self.tokenizer, text, self.max_model_len, self.chars_per_token
        )
        if bound >= self.max_model_len:
            detail = (
                f"has at least {bound} tokens ({len(text)} characters, {probed} of them tokenized to tell)"
            )
            raise self._too_long(detail, param)

    def _too_long(self, detail: str, param: str) -> APIError:
        return APIError(
            f"This model's maximum context length is {self.max_model_len} tokens. However, your {param} "
            f"{detail}. Please reduce the length of the input.",
            HTTPStatus.BAD_REQUEST,
            param,
        )
