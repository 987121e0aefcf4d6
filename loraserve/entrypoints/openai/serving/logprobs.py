"""Engine logprobs (token id -> Logprob per position) in the two OpenAI response shapes."""

from __future__ import annotations

from collections.abc import Callable

from loraserve.entrypoints.openai.serving.protocol import (
    ChatChoiceLogprobs,
    ChatTokenLogprob,
    ChatTopLogprob,
    CompletionLogprobs,
)
from loraserve.outputs import Logprob, PositionLogprobs

Decode = Callable[[int, Logprob | None], str]
# JSON has no -inf; OpenAI-compatible servers report impossible tokens with this floor instead.
MIN_LOGPROB = -9999.0


def _finite(logprob: float) -> float:
    return max(logprob, MIN_LOGPROB)


def _top(position: PositionLogprobs, num_top: int) -> list[tuple[int, Logprob]]:
    """The `num_top` most likely entries of one position, most likely first."""
    if num_top <= 0:
        return []
    ranked = sorted(
        position.items(),
        key=lambda item: (item[1].rank if item[1].rank is not None else 1 << 30, -item[1].logprob),
    )
    return ranked[:num_top]


def _sampled(position: PositionLogprobs | None, token_id: int) -> Logprob | None:
    if position is None:
        return None
    return position.get(token_id)


def completion_logprobs(
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    num_top: int,
    decode: Decode,
    text_offset: int,
) -> CompletionLogprobs:
    """The /v1/completions `logprobs` object for `token_ids` (a slice of the output, for streaming)."""
    result = CompletionLogprobs()
    for token_id, position in zip(token_ids, positions, strict=False):
        sampled = _sampled(position, token_id)
        token = decode(token_id, sampled)
        result.tokens.append(token)
        result.token_logprobs.append(_finite(sampled.logprob) if sampled is not None else None)
        if position is None:
            result.top_logprobs.append(None)
        else:
            top = {decode(tid, lp): _finite(lp.logprob) for tid, lp in _top(position, num_top)}
            if sampled is not None:
                top.setdefault(token, _finite(sampled.logprob))
            result.top_logprobs.append(top)
        result.text_offset.append(text_offset)
        text_offset += len(token)
    return result


def chat_logprobs(
    token_ids: list[int],
    positions: list[PositionLogprobs | None],
    num_top: int,
    decode: Decode,
) -> ChatChoiceLogprobs:
    """The /v1/chat/completions `logprobs` object for `token_ids` (a slice of the output, for streaming)."""
    content: list[ChatTokenLogprob] = []
    for token_id, position in zip(token_ids, positions, strict=False):
        sampled = _sampled(position, token_id)
        token = decode(token_id, sampled)
        tops = []
        for top_id, top_logprob in _top(position or {}, num_top):
            text = decode(top_id, top_logprob)
            tops.append(
                ChatTopLogprob(token=text, logprob=_finite(top_logprob.logprob), bytes=list(text.encode()))
            )
        content.append(
            ChatTokenLogprob(
                token=token,
                logprob=_finite(sampled.logprob) if sampled is not None else MIN_LOGPROB,
                bytes=list(token.encode()),
                top_logprobs=tops,
            )
        )
    return ChatChoiceLogprobs(content=content)
