"""The step-failure policy: how many failed steps in a row the engine survives, and the counters.

A step that raises fails only the requests it ran (`LLMEngine` drops them); this module decides when
failures mean the engine itself is broken: `MAX_CONSECUTIVE_STEP_FAILURES` failed steps with no
successful step in between, or bookkeeping found inconsistent after cleaning up a failed step.
"""

from __future__ import annotations

from loraserve.errors import EngineDeadError

# A transient fault (one bad batch, an out-of-memory spike) rarely repeats three times in a row with
# different batches; a broken device or model does, and then retrying forever only burns requests.
MAX_CONSECUTIVE_STEP_FAILURES = 3


def request_error(exc: BaseException) -> str:
    """The error a request of a failed step ends with (the server answers it with a 500)."""
    return f"The engine failed while running this request's batch ({type(exc).__name__}: {exc}); the request was dropped."


class StepFailureLimitError(EngineDeadError):
    """The engine cannot continue after a failed step; the caller must stop serving."""


class StepFailures:
    """Counts failed steps: in total (for metrics) and in a row (for the give-up decision)."""

    def __init__(self, limit: int = MAX_CONSECUTIVE_STEP_FAILURES) -> None:
        self.limit = limit
        self.total = 0
        self.consecutive = 0

    def succeeded(self) -> None:
        self.consecutive = 0

    def failed(self, exc: BaseException, inconsistency: str | None) -> None:
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
