"""vLLM's beam-search request fields: `use_beam_search`, `best_of`, `length_penalty`, `early_stopping`.

With `use_beam_search` the request becomes `BeamSearchParams`: the beam width is `n` (vLLM's
`to_beam_search_params`), or `best_of` when that is larger (vLLM's older rule: search `best_of` beams,
return the best `n`); the `n` choices come back best first. Without it, `length_penalty` and
`early_stopping` do nothing (vLLM ignores them too) and `best_of` other than 1 is refused (no best-of-n
selection of samples). What beam search cannot honour (stop strings, logprobs, grammars, min_tokens)
is a 400 naming the field rather than silently dropped.
"""

from __future__ import annotations

from http import HTTPStatus

from loraserve.beam_search import BeamSearchParams
from loraserve.entrypoints.openai.serving.errors import APIError
from loraserve.entrypoints.openai.serving.protocol import SamplingRequest
from loraserve.entrypoints.openai.serving.structured_request import structured_outputs_of
from loraserve.sampling_params import SamplingParams


def _refuse(message: str, param: str) -> APIError:
    return APIError(message, HTTPStatus.BAD_REQUEST, param)


def check_beam_fields(request: SamplingRequest) -> None:
    """400s naming the field for what a (non-)beam-search request cannot have."""
    best_of = request.best_of
    if not request.use_beam_search:
        if best_of not in (None, 1):
            raise _refuse(
                "best_of is not supported by this server without use_beam_search: best-of-n selection of "
                "samples is not implemented; use n.",
                "best_of",
            )
        return
    if best_of is not None and best_of < request.n:
        raise _refuse(
            f"best_of must be greater than or equal to n, got n={request.n} and best_of={best_of}.", "best_of"
        )
    unsupported = {
        "stop": bool(request.stop),
        "logprobs": _asks_logprobs(request),
        "prompt_logprobs": request.prompt_logprobs is not None,
        "min_tokens": request.min_tokens > 0,
        "response_format": structured_outputs_of(request) is not None,
    }
    for field, asked in unsupported.items():
        if asked:
            raise _refuse(f"{field} is not supported with use_beam_search.", field)


def _asks_logprobs(request: SamplingRequest) -> bool:
    logprobs = getattr(request, "logprobs", None)
    return logprobs is True or (not isinstance(logprobs, bool) and logprobs is not None)


def beam_search_params(request: SamplingRequest, max_tokens: int) -> BeamSearchParams:
    """The request's `BeamSearchParams` (call `check_beam_fields` first)."""
    width = max(request.n, request.best_of or request.n)
    try:
        return BeamSearchParams(
            beam_width=width,
            max_tokens=max_tokens,
            ignore_eos=request.ignore_eos,
            temperature=request.temperature if request.temperature is not None else 0.0,
            length_penalty=request.length_penalty,
            include_stop_str_in_output=request.include_stop_str_in_output,
            early_stopping=request.early_stopping,
            num_return_sequences=request.n,
            stop_token_ids=tuple(request.stop_token_ids or ()),
            skip_special_tokens=request.skip_special_tokens,
        )
    except ValueError as exc:
        field = next((f for f in ("length_penalty", "temperature", "stop_token_ids") if f in str(exc)), None)
        raise _refuse(str(exc), field or "use_beam_search") from exc


def num_choices(params: SamplingParams | BeamSearchParams) -> int:
    """How many choices a prompt's response has: n, or the beams returned."""
    return params.num_returned if isinstance(params, BeamSearchParams) else params.n
