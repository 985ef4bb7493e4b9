"""Spans of one request on the coordinator: `llm_request` (SERVER, the trace's root) and its rounds.

    llm_request                      SERVER; child of the caller's traceparent, if any
    ├── spec_round  (index 0)        one per round, up to max_round_spans
    │   ├── Propose  CLIENT → DraftWorker/Propose SERVER → spec_propose
    │   └── Verify   CLIENT → TargetWorker/Verify SERVER → spec_verify
    ├── ...
    ├── spec_rounds (rounds 64-127)  past max_round_spans: one summary span per group of
    │   └── ...                      max_round_spans rounds, parent of their worker calls
    └── spec_round_unused (index n)  a round whose work started ahead, never run (ssd), or
                                     cut short by the request's end (coordinator/rounds_ahead.py)

Use from a round loop (sd_rounds, ssd_rounds):

    with gen.trace.round(index) as span:     # the round's worker calls become its children
        ...
        span.record(result)                  # a RoundResult (ssd: hit, branches, backup too)

and, for work a later round starts before it runs (ssd: verifies sent ahead, early Speculates):

    with gen.trace.ahead(index + 1):         # calls and tasks started here: that round's
        ...

Nothing here costs more than a few attribute checks when spans are not recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import AsyncIterator, Callable, Iterator

import grpc
from opentelemetry import trace
from opentelemetry.context import Context
from opentelemetry.trace import SpanKind, Status, StatusCode

from coordinator.policy import RoundPlan
from coordinator.round_result import RoundResult
from specd.observability.telemetry import context_from_metadata, trace_id_hex
from specd.wire.modes import mode_name

DEFAULT_MAX_ROUND_SPANS = 64
FINISH_REASONS = {1: "stop", 2: "length"}
# A round begun ahead (ssd) that never ran: its calls were for an outcome that did not come; or a
# round the request's end cut short (its rounds run one ahead of its text: a stop string, a cancel).
UNUSED_ROUND = "spec_round_unused"


@dataclasses.dataclass(frozen=True)
class Caller:
    """The call a request's span serves, in its protocol's terms: the caller's trace context
    (W3C traceparent, if it sent one), the protocol's span attributes, and, once the request has
    failed, the status the caller is told (the span's attributes for it, and its message)."""

    parent: Context
    attributes: dict
    failure_status: Callable[[BaseException], tuple[dict, str | None]]


def grpc_caller(grpc_context, method: str) -> Caller:
    """A Coordinator RPC: its metadata's traceparent, and its gRPC status (CANCELLED for a
    caller that went away)."""

    def failure_status(exc: BaseException) -> tuple[dict, str | None]:
        code, details = grpc_context.code(), grpc_context.details()
        if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
            code, details = grpc.StatusCode.CANCELLED, "the caller cancelled the call"
        return ({"rpc.grpc.status_code": code.value[0]} if code is not None else {}), details

    return Caller(
        parent=context_from_metadata(grpc_context.invocation_metadata()),
        attributes={"rpc.system": "grpc", "rpc.service": "specd.v1.Coordinator", "rpc.method": method},
        failure_status=failure_status,
    )


def _start_llm_request(tracer: trace.Tracer, caller: Caller) -> trace.Span:
    return tracer.start_span(
        "llm_request", context=caller.parent, kind=SpanKind.SERVER, attributes=caller.attributes, set_status_on_exception=False
    )


def _record_failure(span: trace.Span, caller: Caller, exc: BaseException) -> None:
    """The status the caller got, on the span; a cancelled call records no exception."""
    if not span.is_recording():
        return
    attributes, details = caller.failure_status(exc)
    if not isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        span.record_exception(exc)
    span.set_attributes(attributes)
    span.set_status(Status(StatusCode.ERROR, details or f"{type(exc).__name__}: {exc}"))


@contextlib.contextmanager
def llm_request(tracer: trace.Tracer, caller: Caller) -> Iterator[trace.Span]:
    """The request's SERVER span, current for the whole call: the trace's root on the
    coordinator, or a child of the caller's span when the call carries a `traceparent`.
    (The public service is not wrapped by the gRPC server interceptor: this span is its
    server span, so the trace does not open with an empty RPC span.) For a coroutine only:
    a streaming call uses llm_request_stream."""
    span = _start_llm_request(tracer, caller)
    with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
        try:
            yield span
        except BaseException as exc:
            _record_failure(span, caller, exc)
            raise


async def llm_request_stream(
    tracer: trace.Tracer, caller: Caller, open_messages: Callable[[str], AsyncIterator]
) -> AsyncIterator:
    """llm_request for a streaming call: the messages of open_messages(trace_id), each made
    with the span current. The span is never current across a yield: a caller that cancels
    while a message is being written leaves this generator at its yield, and asyncio closes it
    later in another task, where detaching a context attached here would fail."""
    span = _start_llm_request(tracer, caller)
    messages = open_messages(trace_id_hex(span))
    try:
        while (message := await _next_with(span, messages)) is not _END:
            yield message
    except BaseException as exc:
        _record_failure(span, caller, exc)
        raise
    finally:
        with trace.use_span(span, end_on_exit=True, record_exception=False, set_status_on_exception=False):
            await messages.aclose()  # its clean-up (the workers' EndSession) joins the trace


_END = object()


async def _next_with(span: trace.Span, messages: AsyncIterator):
    with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
        return await anext(messages, _END)


def record_request(span: trace.Span, request) -> None:
    """GenAI request attributes of a coordinator.request.ResolvedRequest."""
    if not span.is_recording():
        return
    sampling = request.sampling
    span.set_attributes(
        {
            "gen_ai.operation.name": "text_completion",
            "gen_ai.request.max_tokens": request.max_new_tokens,
            "gen_ai.request.temperature": sampling.temperature,
            "gen_ai.request.top_p": sampling.top_p,
            "gen_ai.request.top_k": sampling.top_k,
            "gen_ai.request.seed": sampling.seed if sampling.seed < 2**63 else str(sampling.seed),
            "gen_ai.response.id": request.request_id,
            "gen_ai.usage.input_tokens": len(request.prompt_ids),
            "specd.request.mode": request.mode,
            "specd.request.num_speculative_tokens": request.num_speculative_tokens,
        }
    )


def record_response(span: trace.Span, finish_reason: int, output_tokens: int, stats, ttft_ms: float | None, e2e_ms: float) -> None:
    """GenAI response attributes and the request's speculation totals (a SpeculationStats)."""
    if not span.is_recording():
        return
    attributes = {
        "gen_ai.response.finish_reasons": [FINISH_REASONS.get(finish_reason, "")],
        "gen_ai.usage.output_tokens": output_tokens,
        "specd.e2e_ms": e2e_ms,
        "specd.mode": mode_name(stats.mode),  # the mode that ran; specd.request.mode is the one asked
        "specd.rounds": stats.rounds,
        "specd.draft_tokens": stats.draft_tokens,
        "specd.accepted_tokens": stats.accepted_tokens,
        "specd.acceptance_rate": stats.acceptance_rate,
        "specd.mean_acceptance_length": stats.mean_acceptance_length,
        "specd.accepted_per_position": list(stats.accepted_per_position),
        "specd.cache_hits": stats.cache_hits,
        "specd.cache_misses": stats.cache_misses,
        "specd.draft_wait_ms": stats.draft_wait_ms,
        "specd.verify_ms": stats.verify_ms,
        "specd.verified_ahead": stats.verified_ahead,
        "specd.speculated_early": stats.speculated_early,
        "specd.queue_ms": stats.queue_ms,
    }
    if ttft_ms is not None:
        attributes["specd.ttft_ms"] = ttft_ms
    if stats.fallback_reason:
        attributes["specd.fallback_reason"] = stats.fallback_reason
    span.set_attributes(attributes)

_TOTALS = ("num_draft", "accepted", "draft_wait_ms", "verify_ms", "cache_hits", "cache_misses", "bonus")


class RoundSpan:
    """What a round may add to its span: its outcome."""

    def __init__(self, span: trace.Span, index: int, summary: dict | None):
        self.span = span
        self.index = index
        self._summary = summary  # the aggregate this round folds into, past max_round_spans

    def record(self, result: RoundResult) -> None:
        """The round's outcome: a RoundResult's fields (ssd: its lookup, branches, backup too)."""
        values = dict(
            mode=result.mode,
            num_draft=result.num_draft,
            accepted=result.accepted,
            next_token_kind="bonus" if result.bonus else "recovered",
            draft_wait_ms=result.draft_wait_ms,
            verify_ms=result.verify_ms,
        )
        if result.fallback_reason:
            values["fallback_reason"] = result.fallback_reason
        if result.hit is not None:  # ssd rounds: looked up in the speculation cache
            values["cache"] = "hit" if result.hit else "miss"
        for key in ("miss", "branches", "backup", "speculate_ms", "verified_ahead", "speculated_early", "target_only"):
            if getattr(result, key):
                values[key] = getattr(result, key)
        if self._summary is not None:
            _fold(self._summary, values)
        elif self.span.is_recording():
            self.span.set_attributes({f"specd.round.{k}": v for k, v in values.items()})

    def record_plan(self, plan: RoundPlan) -> None:
        """What the request's policy planned for the round, and what it planned from."""
        if self._summary is None and self.span.is_recording():
            self.span.set_attributes({
                "specd.round.policy.num_draft": plan.num_draft,
                "specd.round.policy.budget": plan.budget,
                "specd.round.policy.backup": plan.backup,
                "specd.round.policy.running": plan.running,
                "specd.round.policy.acceptance": plan.acceptance,
            })


def _fold(summary: dict, values: dict) -> None:
    for key in ("num_draft", "accepted", "draft_wait_ms", "verify_ms"):
        summary[key] += values.get(key, 0)
    summary["bonus"] += values.get("next_token_kind") == "bonus"
    summary["cache_hits"] += values.get("cache") == "hit"
    summary["cache_misses"] += values.get("cache") == "miss"


@dataclasses.dataclass
class _Group:
    """A `spec_rounds` summary span and the rounds folded into it."""

    span: trace.Span
    totals: dict
    begun: int = 0  # rounds assigned to it (at most max_round_spans)
    settled: int = 0  # of those, rounds that have ended


class RoundTrace:
    """One request's round spans; create it while `llm_request` is the current span.

    A round's span starts when its first worker call does. In ssd that can be before the
    previous round has ended (its verify sent ahead, its Speculate started early: ahead()),
    so round spans may overlap in time; round() then runs the round in the span already open.
    """

    def __init__(self, tracer: trace.Tracer | None = None, max_round_spans: int = DEFAULT_MAX_ROUND_SPANS):
        self._tracer = tracer or trace.NoOpTracer()
        self._parent = trace.set_span_in_context(trace.get_current_span())
        self._max = max(0, max_round_spans)
        self._rounds = 0
        self._open: dict[int, tuple[RoundSpan, _Group | None]] = {}  # begun, not yet run
        self._group: _Group | None = None  # the summary taking new rounds
        self._groups: list[_Group] = []  # summaries not yet ended
        self._ended = False  # the request ended: a round cancelled from now on is one it did not need

    def _begin(self, index: int) -> tuple[RoundSpan, _Group | None]:
        """Round `index`'s span, started now unless it already was (not made current)."""
        if index in self._open:
            return self._open[index]
        self._rounds += 1
        if self._rounds <= self._max or not self._tracer_records():
            span = self._tracer.start_span("spec_round", context=self._parent)
            if span.is_recording():
                span.set_attribute("specd.round.index", index)
            opened = RoundSpan(span, index, None), None
        else:
            group = self._group_for(index)
            opened = RoundSpan(group.span, index, group.totals), group
        self._open[index] = opened
        return opened

    @contextlib.contextmanager
    def ahead(self, index: int) -> Iterator[None]:
        """Round `index`'s span current while its work starts before it runs (calls made in
        here, tasks created in here, are its children); the span stays open for round()."""
        span = self._begin(index)[0].span
        with trace.use_span(span, end_on_exit=False, record_exception=False, set_status_on_exception=False):
            yield

    @contextlib.contextmanager
    def round(self, index: int) -> Iterator[RoundSpan]:
        """The span of round `index` (begun now, or by ahead()), current while the round's
        worker calls are made; ended when the round is."""
        round_span, group = self._begin(index)
        del self._open[index]
        if group is None:
            with trace.use_span(round_span.span, end_on_exit=True), self._unused_if_cut_short(round_span.span):
                yield round_span
            return
        with trace.use_span(group.span, end_on_exit=False):
            yield round_span
        group.totals["rounds"] += 1
        group.totals["first_index"] = min(group.totals["first_index"], index)
        group.totals["last_index"] = max(group.totals["last_index"], index)
        self._settle(group)

    def end_rounds(self) -> None:
        """The request has ended: a round cancelled after this (one under way ahead of the
        request's text) is named UNUSED_ROUND, not taken for a round that ran and failed."""
        self._ended = True

    @contextlib.contextmanager
    def _unused_if_cut_short(self, span: trace.Span) -> Iterator[None]:
        try:
            yield
        except asyncio.CancelledError:
            if self._ended and span.is_recording():
                span.update_name(UNUSED_ROUND)
            raise

    def _tracer_records(self) -> bool:
        return trace.get_current_span(self._parent).is_recording()

    def _group_for(self, index: int) -> _Group:
        """The summary a round begun now folds into: the open one, or a new one once it is full."""
        if self._group is None or self._group.begun >= max(self._max, 1):
            span = self._tracer.start_span("spec_rounds", context=self._parent)
            totals = dict.fromkeys(_TOTALS, 0) | {"rounds": 0, "first_index": index, "last_index": index}
            self._group = _Group(span, totals)
            self._groups.append(self._group)
        self._group.begun += 1
        return self._group

    def _settle(self, group: _Group) -> None:
        """One more of the group's rounds is over: end its span once all of a full group are."""
        group.settled += 1
        if group.settled >= group.begun >= max(self._max, 1):
            self._end_group(group)

    def _end_group(self, group: _Group) -> None:
        if group not in self._groups:
            return
        self._groups.remove(group)
        if group is self._group:
            self._group = None
        group.span.set_attributes({f"specd.rounds.{k}": v for k, v in group.totals.items()})
        group.span.end()

    def close(self) -> None:
        """End what is still open: a summary (the request finished mid-group), and a round
        begun ahead that never ran (the request ended on another outcome than the one its
        verify went ahead for), renamed so that `spec_round` spans stay the rounds that ran.
        Safe to repeat."""
        for round_span, group in self._open.values():
            if group is None and round_span.span.is_recording():
                round_span.span.update_name(UNUSED_ROUND)
                round_span.span.end()
        self._open.clear()
        for group in list(self._groups):
            self._end_group(group)
