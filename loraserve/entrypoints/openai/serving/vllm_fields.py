"""vLLM's request fields that the serving layer applies, with vLLM's semantics and texts.

`request_id` names the response (`<prefix>-<request_id>`, as vLLM's responses do; the engine's own
id stays unique, so two clients sending one id never collide), `truncate_prompt_tokens` keeps a
prompt's last k tokens (its first k with `truncation_side: "right"`), `-1` logprob counts mean the
whole vocabulary (then capped by `--max-logprobs` with vLLM's text), `prompt_logprobs` are reported
in vLLM's JSON shape, and usage carries `prompt_tokens_details.cached_tokens` with
`--enable-prompt-tokens-details`.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
from http import HTTPStatus
from typing import Any

from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.names import check_name
from loraserve.entrypoints.openai.serving.protocol import PromptTokenUsageInfo, SamplingRequest, UsageInfo
from loraserve.outputs import Logprob, PositionLogprobs

# JSON has no -inf: the floor OpenAI-compatible servers report for impossible tokens.
_MIN_LOGPROB = -9999.0


def check_vllm_fields(request: SamplingRequest) -> None:
    """vLLM's request checks, with its texts, as 400s naming the field."""

    def refuse(message: str, param: str) -> None:
        raise APIError(message, HTTPStatus.BAD_REQUEST, param)

    if request.request_id is not None:  # it names the response and goes into logs: a plain name
        check_name(request.request_id, "request_id")
    options = request.stream_options
    if options is not None and options.model_dump(exclude_unset=True) and not request.stream:
        refuse("Stream options can only be defined when `stream=True`.", "stream_options")
    prompt_logprobs = request.prompt_logprobs
    if prompt_logprobs is not None:
        if request.stream and (prompt_logprobs > 0 or prompt_logprobs == -1):
            refuse("`prompt_logprobs` are not available when `stream=True`.", "prompt_logprobs")
        if prompt_logprobs < -1:
            refuse("`prompt_logprobs` must be a positive value or -1.", "prompt_logprobs")
    if request.cache_salt is not None and not request.cache_salt:
        refuse("Parameter 'cache_salt' must be a non-empty string if provided.", "cache_salt")
    top = getattr(request, "top_logprobs", None)  # chat completions
    if top is not None:
        if top < -1:
            refuse("`top_logprobs` must be a positive value or -1.", "top_logprobs")
        if (top == -1 or top > 0) and not getattr(request, "logprobs", False):
            refuse("when using `top_logprobs`, `logprobs` must be set to true.", "top_logprobs")
    if getattr(request, "continue_final_message", False) and getattr(request, "add_generation_prompt", False):
        refuse(
            "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
            "continue_final_message",
        )


def response_id(prefix: str, request: SamplingRequest) -> str:
    """vLLM's response id: `<prefix>-<request_id>`, a random one when the request names none."""
    return f"{prefix}-{request.request_id or uuid.uuid4().hex}"


def engine_request_id(response_id: str, request: SamplingRequest) -> str:
    """The engine's id: the response id, made unique when the client chose it."""
    return f"{response_id}-{uuid.uuid4().hex[:8]}" if request.request_id else response_id


def truncate_prompt(prompt_ids: list[int], request: SamplingRequest, max_model_len: int) -> list[int]:
    """The last `truncate_prompt_tokens` tokens (-1: max_model_len), or the first ones with
    `truncation_side: "right"`; 400 beyond max_model_len."""
    keep = request.truncate_prompt_tokens
    if keep is None:
        return prompt_ids
    if keep == -1:
        keep = max_model_len
    if keep > max_model_len:
        raise APIError(  # vLLM's text
            f"truncate_prompt_tokens value ({keep}) is greater than max_model_len ({max_model_len}). "
            "Please, select a smaller truncation size.",
            HTTPStatus.BAD_REQUEST,
            "truncate_prompt_tokens",
        )
    if keep <= 0:
        return prompt_ids
    return prompt_ids[:keep] if request.truncation_side == "right" else prompt_ids[-keep:]


def logprob_count(value: int | None, vocab_size: int) -> int | None:
    """vLLM's -1 is the whole vocabulary (the engine then applies --max-logprobs, with vLLM's text)."""
    return vocab_size if value == -1 else value


def prompt_logprobs_json(
    positions: list[PositionLogprobs | None] | None, render: Callable[[int, Logprob | None], str]
) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs`: per prompt position None (the first) or token id -> its logprob,
    rank and text."""
    if positions is None:
        return None
    result: list[dict[str, Any] | None] = []
    for position in positions:
        if position is None:
            result.append(None)
            continue
        result.append(
            {
                str(token_id): {
                    "logprob": max(lp.logprob, _MIN_LOGPROB),
                    "rank": lp.rank,
                    "decoded_token": render(token_id, lp),
                }
                for token_id, lp in position.items()
            }
        )
    return result


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None, details: bool) -> UsageInfo:
    """Usage; with `details` (--enable-prompt-tokens-details) the prompt tokens served from the
    prefix cache, as current vLLM reports them: `{"cached_tokens": 0}` when there were none."""
    info = UsageInfo(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )
    if details:
        info.prompt_tokens_details = PromptTokenUsageInfo(cached_tokens=cached_tokens or 0)
    return info
