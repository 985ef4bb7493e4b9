"""An ssd round's worker calls sit under its own spec_round span, also when they started during
the round before (verifies sent ahead, Speculates started early or on a hit sent ahead).

Which round a call is for is read from what it sent, independently of the spans: the committed
tokens it continues (a round starts where the rounds before it left the text) or, for a
VerifyAfter, the verify it follows. The call is recorded as it is made, with the span then
current (what its CLIENT span's parent is), over real gRPC servers on 127.0.0.1."""

from __future__ import annotations

import collections
import dataclasses
import time

import pytest
from opentelemetry import trace

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, running_stack
from tests.stack import coordinator_settings, slow_verify
from tests.tracing import in_memory_tracing

WORKER_CALLS = ("Verify", "VerifyAfter", "Speculate", "Propose")
ROUND_SPANS = ("spec_round", "spec_round_unused")
PROMPT = [5, 17, 42, 9, 3, 28]


@dataclasses.dataclass(frozen=True)
class Call:
    method: str
    parent: int  # the span current when the call was made
    request: object


def _record_calls(stub, methods: tuple[str, ...], calls: list[Call]) -> None:
    """Record each call `stub` makes with the span current at that moment, then make it."""
    for method in methods:
        original = getattr(stub, method)

        def recorded(request, *args, _method=method, _original=original, **kwargs):
            calls.append(Call(_method, trace.get_current_span().get_span_context().span_id, request))
            return _original(request, *args, **kwargs)

        setattr(stub, method, recorded)


@pytest.fixture(scope="module")
def ssd_ahead(tiny_pair):
    """A stack whose ssd rounds go through verifies sent ahead, its worker calls recorded."""
    providers, exporters = in_memory_tracing()
    with running_stack(*tiny_pair, tracer_providers=providers) as stack:
        servicer = stack.coordinator.servicer
        slow_verify(stack.target.servicer.runner, 0.05)  # slower than the tiny draft's tree build
        calls: list[Call] = []
        _record_calls(servicer.target._stub, ("Verify", "VerifyAfter"), calls)
        _record_calls(servicer.draft._stub, ("Speculate", "Propose"), calls)
        with coordinator_settings(servicer, ssd_budget=16, ssd_backup="jit"):
            yield stack, exporters["coordinator"], calls


def _round_starts(prompt_len: int, rounds: list) -> list[int]:
    """Where each round that ran starts in the text, and (last) where the text ends."""
    starts = [prompt_len]
    for span in sorted(rounds, key=lambda s: s.attributes["specd.round.index"]):
        starts.append(starts[-1] + span.attributes["specd.round.accepted"] + 1)
    return starts


def _round_of(call: Call, text: list[int], starts: list[int]) -> int:
    """The round `call` is for, from the tokens it sent (`text`: prompt and output)."""
    if call.method == "VerifyAfter":  # the round after the one whose verify it follows
        return starts.index(call.request.after) + 1
    tail = call.request.committed
    start, tokens = tail.start, list(tail.token_ids)
    if text[start : start + len(tokens)] == tokens and start + len(tokens) in starts:
        return starts.index(start + len(tokens))  # a round that ran continues the text itself
    # A Speculate started early for an outcome that did not come: it was for the round after
    # the one during which the text and its guess part.
    assert call.method == "Speculate", call
    real = start
    while real - start < len(tokens) and real < len(text) and text[real] == tokens[real - start]:
        real += 1
    return max(i for i, at in enumerate(starts) if at <= real) + 1


def _generate(stack) -> pb.GenerateResponse:
    request = pb.GenerateRequest(
        prompt_token_ids=pb.TokenIds(ids=PROMPT),
        max_new_tokens=32,
        ignore_eos=True,
        speculation=pb.SpeculationParams(mode=pb.SPECULATION_MODE_SSD, num_speculative_tokens=3),
    )
    return stack.stub().Generate(request, timeout=CALL_TIMEOUT_S)


def _client_spans_in(exporter, trace_id: int, expected: collections.Counter, deadline_s: float = 10.0) -> dict:
    """The trace's coordinator spans once a CLIENT span has ended for every recorded call (a
    call cancelled after the response ends a moment later)."""
    until = time.monotonic() + deadline_s
    while True:
        spans = [s for s in exporter.get_finished_spans() if s.context.trace_id == trace_id]
        clients = collections.Counter(
            (s.name.rsplit("/", 1)[-1], s.parent.span_id)
            for s in spans
            if s.kind == trace.SpanKind.CLIENT and s.name.rsplit("/", 1)[-1] in WORKER_CALLS
        )
        if clients == expected or time.monotonic() > until:
            assert clients == expected  # one CLIENT span per call made, under the span then current
            return {s.context.span_id: s for s in spans}
        time.sleep(0.05)


def test_every_worker_call_is_a_child_of_its_own_round(ssd_ahead):
    stack, exporter, calls = ssd_ahead
    exporter.clear()
    calls.clear()
    response = _generate(stack)
    assert response.stats.mode == pb.SPECULATION_MODE_SSD and response.stats.verified_ahead > 0
    trace_id = int(response.trace_id, 16)
    made = list(calls)
    spans = _client_spans_in(exporter, trace_id, collections.Counter((c.method, c.parent) for c in made))

    ran = [s for s in spans.values() if s.name == "spec_round"]
    assert len(ran) == response.stats.rounds
    by_index = {s.attributes["specd.round.index"]: s for s in spans.values() if s.name in ROUND_SPANS}
    starts = _round_starts(len(PROMPT), ran)
    text = PROMPT + list(response.token_ids)
    assert starts[-1] == len(text)

    rounds_under = collections.defaultdict(set)  # round span -> the rounds its calls were for
    for call in made:
        index = _round_of(call, text, starts)
        assert call.parent == by_index[index].context.span_id, (call.method, index)
        rounds_under[call.parent].add(index)
    for span in by_index.values():
        assert rounds_under[span.context.span_id] <= {span.attributes["specd.round.index"]}

    # The calls sent ahead still start during the round before theirs: no round waited for them.
    early = [c for c in made if c.method == "VerifyAfter"]
    assert early
    for call in early:
        index = _round_of(call, text, starts)
        assert by_index[index].start_time < by_index[index - 1].end_time


def test_rounds_sent_ahead_overlap_in_the_picture(ssd_ahead, tmp_path):
    """`specd trace` draws overlapping rounds on alternate rows and says so in its legend."""
    from specd.cli.trace import _legend, draw, overlapping

    stack, exporter, _ = ssd_ahead
    exporter.clear()
    response = _generate(stack)
    rounds = sorted(
        (s for s in exporter.get_finished_spans() if s.name in ROUND_SPANS and f"{s.context.trace_id:032x}" == response.trace_id),
        key=lambda s: s.start_time,
    )
    as_stored = [{"name": s.name, "start_ns": s.start_time, "end_ns": s.end_time, "attributes": dict(s.attributes)} for s in rounds]
    assert overlapping(as_stored)
    root = {"name": "llm_request", "trace_id": response.trace_id, "start_ns": rounds[0].start_time,
            "end_ns": rounds[-1].end_time, "attributes": {"specd.mode": "ssd"}, "kind": "SERVER"}
    spans = [root] + [dict(s, kind="INTERNAL", trace_id=response.trace_id) for s in as_stored]
    assert "mode ssd" in draw(spans, tmp_path / "t.png")
    labels = [h.get_label() for h in _legend(as_stored, 0, 0)]
    assert any("alternate rows" in label for label in labels)


def test_rounds_begun_ahead_keep_their_calls_and_fold_past_the_cap():
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

    from coordinator.round_result import RoundResult
    from coordinator.round_trace import RoundTrace

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    def call(index: int) -> None:
        with tracer.start_as_current_span("worker_call", attributes={"for_round": index}):
            pass

    with tracer.start_as_current_span("llm_request"):
        rounds = RoundTrace(tracer, max_round_spans=2)
        for index in range(4):  # each round starts the next one's work before it ends
            with rounds.round(index) as span:
                call(index)
                with rounds.ahead(index + 1):
                    call(index + 1)
                span.record(RoundResult(index, "sd", [1, 2], [], 1, 1, False, 0.0, 0.0, ""))
        rounds.close()
    spans = exporter.get_finished_spans()
    own = {s.context.span_id: s for s in spans if s.name in ("spec_round", "spec_rounds", "spec_round_unused")}
    (ran_0, ran_1) = sorted((s for s in own.values() if s.name == "spec_round"), key=lambda s: s.start_time)
    assert [ran_0.attributes["specd.round.index"], ran_1.attributes["specd.round.index"]] == [0, 1]
    assert ran_1.start_time < ran_0.end_time  # round 1 began when its work did
    # Groups of two: rounds 2 and 3 ran; round 4 was begun (its work went out), never ran.
    summaries = sorted((s for s in own.values() if s.name == "spec_rounds"), key=lambda s: s.start_time)
    assert [(s.attributes["specd.rounds.first_index"], s.attributes["specd.rounds.rounds"]) for s in summaries] == [(2, 2), (4, 0)]
    assert summaries[0].attributes["specd.rounds.accepted"] == 2
    assert not [s for s in own.values() if s.name == "spec_round_unused"]  # round 4 was folded
    parents = {0: ran_0, 1: ran_1, 2: summaries[0], 3: summaries[0], 4: summaries[1]}
    for worker_call in (s for s in spans if s.name == "worker_call"):
        assert own[worker_call.parent.span_id] is parents[worker_call.attributes["for_round"]]

    exporter.clear()
    with tracer.start_as_current_span("llm_request"):
        rounds = RoundTrace(tracer)
        with rounds.round(0):
            with rounds.ahead(1):
                call(1)
        rounds.close()
        rounds.close()  # idempotent
    (unused,) = [s for s in exporter.get_finished_spans() if s.name == "spec_round_unused"]
    assert unused.attributes["specd.round.index"] == 1
    (worker_call,) = [s for s in exporter.get_finished_spans() if s.name == "worker_call"]
    assert worker_call.parent.span_id == unused.context.span_id
