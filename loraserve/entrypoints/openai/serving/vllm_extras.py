"""vLLM's extra request fields that this server does not honour: refused by name, never ignored.

The OpenAI-style models accept unknown fields (clients send new OpenAI fields all the time, and those
are logged and ignored). vLLM's own extras are another matter: a client that sends
`logits_processors` expects a different result, so such a request gets a 400 that
names the field. Each entry lists the values that mean "off" (vLLM's defaults), which are accepted.
Fields loraserve honours (use_beam_search, best_of, length_penalty, early_stopping, top_k, min_p, repetition_penalty, min_tokens, stop_token_ids, ignore_eos,
include_stop_str_in_output, skip_special_tokens, spaces_between_special_tokens,
return_tokens_as_token_ids, chat_template, chat_template_kwargs, add_generation_prompt, echo,
prompt_logprobs, truncate_prompt_tokens, continue_final_message, documents, request_id,
return_token_ids, response_format, structured_outputs and the guided_* fields, logit_bias,
allowed_token_ids, bad_words, tools, tool_choice and parallel_tool_calls; priority and cache_salt are
checked by the serving layer) are declared in
`protocol.py` and never reach this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from http import HTTPStatus
from typing import Any

from loraserve.entrypoints.openai.serving.errors import APIError

_OFF: tuple[Any, ...] = (None, False, [], {}, "")


@dataclass(frozen=True, slots=True)
class Extra:
    why: str  # what the server lacks, completing "<field> is not supported: ..."
    off: tuple[Any, ...] = _OFF  # values that ask for nothing (vLLM's default among them)
    chat_off: tuple[Any, ...] | None = None  # chat completions' "off" values, when they differ


EXTRAS: dict[str, Extra] = {
    "logits_processors": Extra("custom logits processors are not supported"),
    "kv_transfer_params": Extra("KV transfer between instances is not implemented"),
    "vllm_xargs": Extra("no extra arguments are read"),
    "prompt_embeds": Extra("prompts are text or token ids"),
    "add_special_tokens": Extra(
        "prompts are always tokenized with the endpoint's default (completions add them, chat does not)",
        (None, True),
        chat_off=(None, False),
    ),
    "mm_processor_kwargs": Extra("multimodal inputs are not supported"),
    "media_io_kwargs": Extra("multimodal inputs are not supported"),
    "reasoning_effort": Extra("reasoning parsers are not supported"),
    "include_reasoning": Extra("reasoning parsers are not supported", (None, True)),
}


def refuse_unsupported_extras(extra_fields: dict[str, Any], is_chat: bool) -> None:
    """APIError 400 naming the first vLLM extra field whose value asks for something not served."""
    for name, value in extra_fields.items():
        extra = EXTRAS.get(name)
        if extra is None:
            continue
        off = extra.chat_off if is_chat and extra.chat_off is not None else extra.off
        if not any(_same(value, ok) for ok in off):
            raise APIError(
                f"{name} is not supported by this server: {extra.why}.", HTTPStatus.BAD_REQUEST, name
            )


def _same(value: Any, ok: Any) -> bool:
    """JSON equality where a flag is not a number (false is not 0) but 1 is 1.0."""
    if isinstance(value, bool) or isinstance(ok, bool) or value is None or ok is None:
        return value is ok
    if isinstance(value, (int, float)) and isinstance(ok, (int, float)):
        return value == ok
    return type(value) is type(ok) and value == ok
