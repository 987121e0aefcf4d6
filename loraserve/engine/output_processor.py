"""After sampling: append tokens, detokenize, apply stop conditions, and build RequestOutputs."""

from __future__ import annotations

from typing import Any

from loraserve.engine.detokenizer import find_stop_string
from loraserve.engine.sequence import Request, Sequence, SequenceStatus
from loraserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput


class OutputProcessor:
    def __init__(self, tokenizer: Any, eos_token_id: int | None, max_model_len: int) -> None:
        self.tokenizer = tokenizer
        self.eos_token_id = eos_token_id
        self.max_model_len = max_model_len
        self._token_text: dict[int, str] = {}

    def decode_token(self, token_id: int) -> str:
        text = self._token_text.get(token_id)
        if text is None:
            text = self.tokenizer.decode([token_id]) if self.tokenizer is not None else ""
            self._token_text[token_id] = text
        return text

    def with_text(self, entry: dict[int, Logprob] | None) -> PositionLogprobs | None:
        if entry is None:
            return None
        for token_id, lp in entry.items():
            lp.decoded_token = self.decode_token(token_id)
        return entry

    def append_token(
        self, seq: Sequence, token_id: int, logprob: float, top: dict[int, Logprob] | None
    ) -> None:
        """Add one sampled token to `seq` and finish it if a stop condition holds."""
        seq.token_ids.append(token_id)
        seq.cumulative_logprob += logprob
        if seq.params.logprobs is not None:
            if seq.logprobs is None:
                seq.logprobs = []
            seq.logprobs.append(self.with_text(top) or {})
        delta_len = 0
        if seq.detokenizer is not None:
            delta = seq.detokenizer.append(token_id)
            seq.output_text += delta
            delta_len = len(delta)
        self._check_stop(seq, token_id, delta_len)

    def _check_stop(self, seq: Sequence, token_id: int, delta_len: int) -> None:
        params = seq.params
        num_out = seq.num_output_tokens
        if num_out >= params.min_tokens:
            if not params.ignore_eos and token_id == self.eos_token_id:
                self.finish(seq, "stop", None)
                return
            if params.stop_token_ids and token_id in params.stop_token_ids:
                self.finish(seq, "stop", token_id)
                return
            if params.stop and seq.detokenizer is not None:
                stops = [params.stop] if isinstance(params.stop, str) else params.stop
                matched, keep = find_stop_string(
                    seq.output_text, delta_len, stops, params.include_stop_str_in_output
                )
                if matched is not None:
                    seq.output_text = seq.output_text[:keep]
                    self.finish(seq, "stop", matched)
                    return
        if params.max_tokens is not None and num_out >= params.max_tokens or seq.num_tokens >= self.max_model_len:
            self.finish(seq, "length", None)

    @staticmethod
    def finish(seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        seq.stop_reason = stop_reason

    @staticmethod
    def _visible_text(seq: Sequence) -> str:
        """Hold back a tail that may still become a stop string, so streams never show one."""
        hold = seq.params.output_text_buffer_length if not seq.is_finished else 0
        return seq.output_text[:-hold] if hold > 0 else seq.output_text

    def build_output(self, request: Request) -> RequestOutput:
        outputs = [
            CompletionOutput(
                index=seq.index,
                text=self._visible_text(seq),
                token_ids=seq.output_token_ids,
                cumulative_logprob=seq.cumulative_logprob if seq.params.logprobs is not None else None,
                logprobs=list(seq.logprobs) if seq.logprobs is not None else None,
                finish_reason=seq.finish_reason,
                stop_reason=seq.stop_reason,
            )
            for seq in request.seqs
        ]
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.is_finished,
            prompt_logprobs=request.prompt_logprobs,
            lora_name=request.lora_name,
            error=request.error,
        )
