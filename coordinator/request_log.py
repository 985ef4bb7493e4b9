"""One request as operations see it: one log line when it ends, and its outcome counted once.

A request that finishes is logged and counted (by finish reason, with its tokens) by
Generator.run, the path both the gRPC and the HTTP front run; one that fails or is cancelled,
before or during its rounds, by the front that tells its caller (counted through
CoordinatorMetrics.observe_failure). The line never holds the prompt or the generated text:

    request request_id=4f2a... mode=ssd status=length prompt_tokens=12 generated_tokens=64
      rounds=17 acceptance=0.812 duration_ms=913.4 trace_id=0af7...

status is the finish reason (stop, length) of a finished request, or the gRPC status code
(INVALID_ARGUMENT, CANCELLED, DEADLINE_EXCEEDED, ...) a failed one ended with.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time

from coordinator.round_trace import FINISH_REASONS

log = logging.getLogger(__name__)

_UNKNOWN = "-"  # a field the request had not reached when it failed (e.g. its mode, before it ran)


@dataclasses.dataclass
class RequestRecord:
    """What the log line says of one request, filled in as the request gets further."""

    request_id: str = ""
    trace_id: str = ""
    mode: str = ""  # the mode that ran: the one asked (auto resolved), or off when no round speculated
    prompt_tokens: int = 0
    generated_tokens: int = 0
    rounds: int = 0
    acceptance: float = 0.0  # accepted / proposed draft tokens (0 when none were proposed)
    started: float = dataclasses.field(default_factory=time.perf_counter)
    ended: bool = False  # logged and counted: nothing more is said of it

    def add_stats(self, stats, generated_tokens: int) -> None:
        """The request's totals so far (a coordinator.stats.RequestStats) and its generated tokens."""
        self.mode = stats.mode
        self.rounds = stats.rounds
        self.acceptance = stats.acceptance_rate
        self.generated_tokens = generated_tokens

    def finished(self, metrics, finish_reason: int) -> None:
        """The request finished (a FinishReason value): logged, and counted on `metrics` if any."""
        if self.ended:
            return
        reason = FINISH_REASONS.get(finish_reason, str(finish_reason))
        if metrics is not None:
            metrics.observe_success(reason, self.prompt_tokens, self.generated_tokens)
        self._end(reason)

    def failed(self, metrics, code_name: str) -> None:
        """The request ended with gRPC status `code_name` without finishing: logged, and counted
        on `metrics` if any. Nothing for a request that had already finished (a stream whose
        caller left once its last message was made)."""
        if self.ended:
            return
        if metrics is not None:
            metrics.observe_failure(code_name)
        self._end(code_name)

    def _end(self, status: str) -> None:
        self.ended = True
        log.info(
            "request request_id=%s mode=%s status=%s prompt_tokens=%d generated_tokens=%d rounds=%d "
            "acceptance=%.3f duration_ms=%.1f trace_id=%s",
            _field(self.request_id),
            self.mode or _UNKNOWN,
            status,
            self.prompt_tokens,
            self.generated_tokens,
            self.rounds,
            self.acceptance,
            (time.perf_counter() - self.started) * 1000.0,
            self.trace_id or _UNKNOWN,
        )


def _field(value: str) -> str:
    """A caller's value as one field of the line: quoted (JSON) when it holds a space or a
    character that is not printable, so that no id can split the line or forge another."""
    if not value:
        return _UNKNOWN
    return value if value.isprintable() and " " not in value and '"' not in value else json.dumps(value)
