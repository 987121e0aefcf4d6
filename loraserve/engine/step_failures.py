"""Step failures: which requests fail when an engine step raises, and when the engine gives up.

A step that raises fails exactly the requests it ran (`StepFailures.step_failed`): their sequences
finish with reason "error" (KV blocks freed), they leave the engine's request table and their final
outputs carry the error; the other requests stay queued and the engine goes on. Requests on an
adapter that could not be activated end with that adapter's error (`adapters_failed`). The engine
itself is broken, and `StepFailureLimitError` says so, after `MAX_CONSECUTIVE_STEP_FAILURES` failed
steps with no successful step in between, or when its bookkeeping is inconsistent after cleaning up a
failed step (`check_consistency`). `LLMEngine.step` calls these; this module owns the policy.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from loraserve.errors import EngineDeadError, LoRAAdapterError

if TYPE_CHECKING:
    from loraserve.engine.output_processor import OutputProcessor
    from loraserve.engine.scheduler import ScheduledSeq, Scheduler
    from loraserve.engine.sequence import Request
    from loraserve.lora.manager import LoRAManager
    from loraserve.outputs import RequestOutput

logger = logging.getLogger(__name__)

# A transient fault (one bad batch, an out-of-memory spike) rarely repeats three times in a row with
# different batches; a broken device or model does, and then retrying forever only burns requests.
MAX_CONSECUTIVE_STEP_FAILURES = 3


def request_error(exc: BaseException) -> str:
    """The error a request of a failed step ends with (the server answers it with a 500)."""
    return f"The engine failed while running this request's batch ({type(exc).__name__}: {exc}); the request was dropped."


def own_error(exc: BaseException) -> str:
    """The error a request ends with when its own work failed and the rest of its batch went on."""
    return f"The engine failed while sampling this request ({type(exc).__name__}: {exc}); the request was dropped."


class StepFailureLimitError(EngineDeadError):
    """The engine cannot continue after a failed step; the caller must stop serving."""


class StepFailures:
    """Ends the requests a step could not serve and counts failed steps: in total (for metrics) and in
    a row (for the give-up decision). `requests` is the engine's request table, which failed requests
    leave; the scheduler finishes their sequences, the output processor builds their last outputs."""

    def __init__(
        self,
        requests: dict[str, Request],
        scheduler: Scheduler,
        outputs: OutputProcessor,
        lora: LoRAManager | None,
        limit: int = MAX_CONSECUTIVE_STEP_FAILURES,
    ) -> None:
        self.requests = requests
        self.scheduler = scheduler
        self.outputs = outputs
        self.lora = lora
        self.limit = limit
        self.total = 0
        self.consecutive = 0
        self.requests_failed_alone = 0  # requests whose own work failed while their batch went on

    def succeeded(self) -> None:
        self.consecutive = 0

    def step_failed(self, scheduled: list[ScheduledSeq], exc: Exception) -> list[RequestOutput]:
        """The step raised: fail exactly the requests of `scheduled`, then check that the queues, KV
        blocks and adapter slots are whole again; StepFailureLimitError if not, or after too many in a row."""
        requests = list(dict.fromkeys(item.seq.request for item in scheduled))
        logger.error(
            "Engine step failed; failing its %d request(s), the others go on", len(requests), exc_info=exc
        )
        outputs = self.fail_requests(requests, request_error(exc), "error")
        self._count(exc, self.check_consistency())
        return outputs

    def requests_failed(self, failed: dict[Request, Exception]) -> list[RequestOutput]:
        """Requests whose own part of a step raised (sampling, output processing, a beam round) while
        the rest of the batch went on: each ends alone with its error. Not a failed step: the give-up
        count is untouched (the step's other requests were served)."""
        outputs: list[RequestOutput] = []
        for request, exc in failed.items():
            if self.requests.get(request.request_id) is not request:
                continue  # ended already (aborted meanwhile)
            logger.error("Request %s failed alone; its batch goes on", request.request_id, exc_info=exc)
            self.requests_failed_alone += 1
            outputs += self.fail_requests([request], own_error(exc), "error")
        return outputs

    def adapters_failed(self, failed: dict[int, Exception]) -> list[RequestOutput]:
        """Every request on an adapter that could not be activated ends with that adapter's error
        (its 4xx when the client's adapter is at fault), whether or not it was in the step."""
        outputs: list[RequestOutput] = []
        if not failed:
            return outputs
        for request in list(self.requests.values()):
            error = failed.get(request.lora_request.lora_id) if request.lora_request else None
            if error is not None:
                cause = error if isinstance(error, LoRAAdapterError) else None
                outputs += self.fail_requests([request], str(error), "abort", cause)
        return outputs

    def fail_requests(
        self, requests: list[Request], error: str, reason: str, cause: Exception | None = None
    ) -> list[RequestOutput]:
        """End `requests` with `error`: their sequences finish (KV blocks freed), they leave the table
        (so no adapter counts them as in use) and their final outputs carry the error (and `cause`,
        when the client's adapter is at fault)."""
        outputs = []
        for request in requests:
            request.error, request.error_cause = error, cause
            for seq in request.seqs:
                if not seq.is_finished:
                    self.scheduler.finish(seq, reason)
            self.requests.pop(request.request_id, None)
            outputs.append(self.outputs.build_output(request))
        return outputs

    def check_consistency(self) -> str | None:
        """What is wrong with the engine's bookkeeping (queues vs requests, KV blocks, adapter slots);
        None if it is sound."""
        unfinished = [seq for r in self.requests.values() for seq in r.seqs if not seq.is_finished]
        problem = self.scheduler.check_consistency(unfinished)
        if problem is None and self.lora is not None:
            problem = self.lora.check_consistency()
        return problem

    def _count(self, exc: BaseException, inconsistency: str | None) -> None:
        """Record a failed step; raise StepFailureLimitError if the engine must not go on."""
        self.total += 1
        self.consecutive += 1
        cause = f"{type(exc).__name__}: {exc}"
        if inconsistency is not None:
            raise StepFailureLimitError(
                f"engine state is inconsistent after a failed step ({cause}): {inconsistency}"
            ) from exc
        if self.consecutive >= self.limit:
            raise StepFailureLimitError(
                f"{self.consecutive} consecutive engine steps failed, the last with {cause}"
            ) from exc
