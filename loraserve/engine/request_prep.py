"""`RequestPrep`: what `LLMEngine.add_request` asks to turn a call's parameters into a request's
sampling params and its sequences.

It owns the per-request rules that come from the model and the tokenizer: a beam search's group
state and the greedy, text-less params of its beams; the request's own copy of its `SamplingParams`
(the generation config's defaults when none are given, the model's extra eos ids as stop tokens, the
max_tokens the prompt leaves) and the refusals of what this engine cannot give (too many logprobs,
stop strings without a tokenizer, bad token ids); and each new `Sequence` (its id from the counter
the scheduler shares for forked beams, seeded generator, detokenizer, grammar state). It reads the
request and writes nothing of the engine's: the request table, admission and adapters stay
`LLMEngine`'s. Engine thread.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch

from loraserve.beam_search import BeamSearchParams
from loraserve.config import ModelConfig
from loraserve.engine.detokenizer import IncrementalDetokenizer
from loraserve.engine.sequence import BeamGroup, Request, Sequence
from loraserve.engine.tokenization import EndOfSequenceIds
from loraserve.sampling_params import MAX_LOGPROBS, SamplingParams
from loraserve.sampling_tokens import SamplingParamsError
from loraserve.structured_output.manager import StructuredOutputs

# Logprob entries (positions x (k + 1)) one request may ask for once k is beyond vLLM's default of 20
# (--max-logprobs raised): each is a Python object in the response, ~170 bytes; `-1` on an 8,000-token
# prompt at a 49k vocabulary asked for 393 million of them.
MAX_LOGPROB_ENTRIES = 1 << 22


class RequestPrep:
    def __init__(
        self,
        model_config: ModelConfig,
        tokenizer: Any,
        eos_ids: EndOfSequenceIds,
        device: torch.device,
        structured: StructuredOutputs,
        seq_ids: Iterator[int],
    ) -> None:
        self.model_config = model_config
        self.tokenizer = tokenizer  # None with skip_tokenizer_init
        self.eos_ids = eos_ids
        self.device = device
        self.structured = structured
        self._seq_ids = seq_ids  # the engine's counter, shared with the scheduler

    def params(
        self, params: SamplingParams | BeamSearchParams | None, num_prompt_tokens: int
    ) -> tuple[BeamGroup | None, SamplingParams]:
        """A beam search's group state (None when sampling) and the request's sampling params; ValueError
        for what this engine cannot give."""
        beam = None
        if isinstance(params, BeamSearchParams):
            beam, params = self._beam_group(params, num_prompt_tokens)
        return beam, self._sampling_params(params, num_prompt_tokens)

    def sequences(self, request: Request, grammar: Any = None) -> list[Sequence]:
        """The request's `params.n` new sequences (one for a beam search), under `grammar` if it has one."""
        return [self._new_sequence(request, i, grammar) for i in range(request.params.n)]

    def _beam_group(self, beam: BeamSearchParams, num_prompt_tokens: int) -> tuple[BeamGroup, SamplingParams]:
        """A beam search's group state and the sampling params of its beams (greedy, no text of their
        own: the output processor decodes the returned beams once)."""
        max_tokens = min(beam.max_tokens, self.model_config.max_model_len - num_prompt_tokens)
        user_stops = frozenset(beam.stop_token_ids)
        stops: frozenset[int] = frozenset()
        if not beam.ignore_eos:
            eos = self.eos_ids.eos_token_id
            stops = user_stops | set(self.eos_ids.extra_eos_ids) | ({eos} if eos is not None else set())
        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        return BeamGroup(beam, max_tokens, stops, user_stops), params

    def _sampling_params(self, params: SamplingParams | None, num_prompt_tokens: int) -> SamplingParams:
        """The request's own copy (the generation config's defaults when None), with the model's extra eos
        ids and the max_tokens left by the prompt; refuses what this engine cannot give it."""
        params = (params or SamplingParams(**self.model_config.sampling_defaults)).clone()
        self._check_params(params)
        _check_entries(params, num_prompt_tokens, self.model_config.max_model_len)
        extra_eos_ids = self.eos_ids.extra_eos_ids
        if extra_eos_ids and not params.ignore_eos:
            params.stop_token_ids = sorted(set(params.stop_token_ids or ()) | set(extra_eos_ids))
        if params.max_tokens is None:
            params.max_tokens = self.model_config.max_model_len - num_prompt_tokens
        return params

    def _check_params(self, params: SamplingParams) -> None:
        vocab_size = self.model_config.vocab_size
        limit = (
            vocab_size
            if self.model_config.max_logprobs == -1
            else min(self.model_config.max_logprobs, vocab_size)
        )
        for kind, value in (("sample", params.logprobs), ("prompt", params.prompt_logprobs)):
            if value is not None and value > limit:
                raise ValueError(  # vLLM's text, which its clients match
                    f"Requested {kind} logprobs of {value}, which is greater than max allowed: {limit}"
                )
        if params.stop and self.tokenizer is None:
            raise ValueError(
                "stop strings need a tokenizer, and this engine was started with skip_tokenizer_init; use "
                "stop_token_ids."
            )
        # vLLM tokenizes bad_words in its engine too (the serving layer does it first, on its pool).
        if self.tokenizer is not None:
            params.update_from_tokenizer(self.tokenizer)
        params.verify_token_ids(vocab_size, None if self.tokenizer is None else len(self.tokenizer))

    def _new_sequence(self, request: Request, index: int, grammar: Any = None) -> Sequence:
        params = request.params
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=self.device).manual_seed(params.seed + index)
        detok = None
        if params.detokenize and self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                request.prompt_token_ids,
                params.skip_special_tokens,
                params.spaces_between_special_tokens,
            )
        return Sequence(
            seq_id=next(self._seq_ids),
            request=request,
            index=index,
            token_ids=list(request.prompt_token_ids),
            num_prompt_tokens=len(request.prompt_token_ids),
            generator=generator,
            detokenizer=detok,
            grammar=self.structured.new_state(grammar) if grammar is not None else None,
        )


def _check_entries(params: SamplingParams, num_prompt_tokens: int, max_model_len: int) -> None:
    """SamplingParamsError (a 400 naming the field) when the logprobs asked for, at a k beyond vLLM's
    default, add up to more than MAX_LOGPROB_ENTRIES."""
    max_tokens = params.max_tokens or max(max_model_len - num_prompt_tokens, 0)
    for field, k, positions in (
        ("prompt_logprobs", params.prompt_logprobs, num_prompt_tokens),
        ("logprobs", params.logprobs, params.n * max_tokens),
    ):
        if k is None or k <= MAX_LOGPROBS:
            continue
        entries = positions * (k + 1)
        if entries > MAX_LOGPROB_ENTRIES:
            raise SamplingParamsError(
                f"{field}={k} over {positions} positions asks for {entries} logprob entries; at most "
                f"{MAX_LOGPROB_ENTRIES} are returned at once (ask for fewer per position, or fewer positions).",
                field,
            )
