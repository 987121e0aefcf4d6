"""After sampling: detokenize, decide stop conditions, record prompt logprobs, build RequestOutputs.

It never changes a sequence: each emitted token becomes a `SampledToken` report (token, logprobs,
finish reason) that the scheduler applies; a sequence may emit several in one step (speculative
decoding), checked one after another as if each were its own step, the first that ends it the last.
What it does own is text: every sequence's detokenizer (stop strings cut there) and each request's
prompt logprobs. A request whose own processing raises fails alone (`failed`), the others go on.
"""

from __future__ import annotations

from typing import Any

from loraserve.engine.detokenizer import find_stop_string
from loraserve.engine.model_runner import PromptLogprobChunk, StepResult
from loraserve.engine.sampler import compute_prompt_logprobs
from loraserve.engine.sequence import Request, Sequence
from loraserve.engine.spec_verify import Verified
from loraserve.engine.step_types import SampledToken
from loraserve.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput

Finish = tuple[str | None, int | str | None]  # (finish_reason, stop_reason)


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

    def process(
        self, result: StepResult, emitted: list[Verified], failed: dict[Request, Exception] | None = None
    ) -> list[SampledToken]:
        """Record the step's prompt logprobs and report what each emitted token does to its sequence
        (a grammar's dead end stops it: "stop", no stop reason). With `failed`: a request whose
        processing raises is added to it and reported no further (the others go on); requests already
        in it are skipped."""
        reports: list[SampledToken] = []
        for chunk in result.prompt_chunks:
            if failed is None or chunk.seq.request not in failed:
                self._guarded(chunk.seq.request, failed, lambda c=chunk: self._record_prompt_logprobs([c]))
        for out in emitted:
            seq = out.seq
            if seq.request.beam is not None:  # a beam's token is its group's choice (Scheduler.update)
                continue
            if failed is not None and seq.request in failed:
                continue
            own = self._guarded(seq.request, failed, lambda o=out: self._reports(o))
            if own is not None:
                reports += own
        if failed:
            reports = [r for r in reports if r.seq.request not in failed]
        return reports

    def _reports(self, out: Verified) -> list[SampledToken]:
        """One sequence's emitted tokens, each checked as if it were its own step; the first that ends
        the sequence is the last."""
        reports = []
        for ahead, token_id in enumerate(out.token_ids):
            report = self._report(out.seq, token_id, out.logprobs[ahead], out.top_logprobs[ahead], ahead)
            if out.dead_end and ahead == len(out.token_ids) - 1:
                report = SampledToken(out.seq, token_id, report.logprob, report.top_logprobs, "stop", None)
            reports.append(report)
            if report.finish_reason is not None:
                break
        return reports
        return reports

    @staticmethod
    def _guarded(request: Request, failed: dict[Request, Exception] | None, fn: Any) -> Any:
        """`fn()`; when it raises and `failed` is given, the request goes into `failed` (None back)."""
        if failed is None:
            return fn()
        try:
            return fn()
        except Exception as exc:
            failed[request] = exc
            return None

    def _report(
        self, seq: Sequence, token_id: int, logprob: float | None, top: dict[int, Logprob] | None, ahead: int
    ) -> SampledToken:
        top_logprobs = (self.with_text(top) or {}) if seq.params.logprobs is not None else None
        delta_len = len(seq.detokenizer.append(token_id)) if seq.detokenizer is not None else 0
        reason, stop_reason = self._check_stop(seq, token_id, delta_len, ahead)
        return SampledToken(seq, token_id, logprob, top_logprobs, reason, stop_reason)

    def _check_stop(self, seq: Sequence, token_id: int, delta_len: int, ahead: int = 0) -> Finish:
        """Whether `token_id`, about to be appended to `seq` after the `ahead` tokens it emitted before
        it this step, ends it; a matched stop string is cut."""
        params = seq.params
        num_output_tokens = seq.num_output_tokens + 1 + ahead
        if num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id == self.eos_token_id:
                self._drop_stop_token_text(seq, delta_len)
                return "stop", None
            if params.stop_token_ids and token_id in params.stop_token_ids:
                self._drop_stop_token_text(seq, delta_len)
                return "stop", token_id
            if params.stop and seq.detokenizer is not None:
                stops = [params.stop] if isinstance(params.stop, str) else params.stop
                matched, keep = find_stop_string(
                    seq.output_text, delta_len, stops, params.include_stop_str_in_output
                )
                if matched is not None:
                    seq.detokenizer.truncate(keep)
                    return "stop", matched
        is_max_tokens = params.max_tokens is not None and num_output_tokens >= params.max_tokens
        if is_max_tokens or seq.num_tokens + 1 + ahead >= self.max_model_len:
            return "length", None
        return None, None

    @staticmethod
    def _drop_stop_token_text(seq: Sequence, delta_len: int) -> None:
        """The stop token's own text is not output (vLLM's rule) unless include_stop_str_in_output:
        with skip_special_tokens=False, "</s>" would otherwise end the text (and a tool call parser's)."""
        if delta_len and seq.detokenizer is not None and not seq.params.include_stop_str_in_output:
            seq.detokenizer.truncate(len(seq.detokenizer.output_text) - delta_len)

    def _record_prompt_logprobs(self, chunks: list[PromptLogprobChunk]) -> None:
        for chunk in chunks:
            request = chunk.seq.request
            if chunk.seq.index != 0:
                continue
            if request.prompt_logprobs is None:
                request.prompt_logprobs = [None]
            # After a preemption the prompt is recomputed: skip positions already recorded.
            skip = max(0, len(request.prompt_logprobs) - 1 - chunk.start)
            logits = chunk.logits[skip:]
            start = chunk.start + skip
            if logits.shape[0] == 0:
                continue
            targets = request.prompt_token_ids[start + 1 : start + 1 + logits.shape[0]]
            entries = compute_prompt_logprobs(logits, targets, request.params.prompt_logprobs or 0)
            request.prompt_logprobs.extend(self.with_text(e) for e in entries)

    def _beam_outputs(self, request: Request) -> list[CompletionOutput]:
        """A beam search's result: its best finished hypotheses, best first (none until it ends)."""
        group = request.beam
        assert group is not None
        if not group.done:
            return []
        skip = group.params.skip_special_tokens
        return [
            CompletionOutput(
                index=i,
                text=self.tokenizer.decode(hyp.token_ids, skip_special_tokens=skip) if self.tokenizer else "",
                token_ids=list(hyp.token_ids),
                cumulative_logprob=hyp.cum_logprob,
                finish_reason=hyp.finish_reason,
                stop_reason=hyp.stop_reason,
            )
            for i, hyp in enumerate(group.finished[: group.params.num_returned])
        ]

    @staticmethod
    def _visible_text(seq: Sequence) -> str:
        """Hold back a tail that may still become a stop string, so streams never show one."""
        hold = seq.params.output_text_buffer_length if not seq.is_finished else 0
        return seq.output_text[:-hold] if hold > 0 else seq.output_text

    def build_output(self, request: Request) -> RequestOutput:
        outputs = (
            self._beam_outputs(request)
            if request.beam is not None
            else [
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
        )
        return RequestOutput(
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=outputs,
            finished=request.is_finished,
            prompt_logprobs=request.prompt_logprobs,
            lora_name=request.lora_name,
            error=request.error,
            error_cause=request.error_cause,
            metrics=_timing(request),
            num_cached_tokens=max(request.num_cached_tokens, 0),
        )


def _timing(request: Request) -> dict[str, float]:
    """The engine-side times the serving layer's vLLM latency metrics (queue, prefill) need."""
    times = {"arrival_time": request.arrival_time}
    if request.first_scheduled_time is not None:
        times["first_scheduled_time"] = request.first_scheduled_time
    return times
