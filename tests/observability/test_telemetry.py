"""Tracing over real gRPC servers on port 0, each service with its own in-memory exporter:
one trace per request across the three services, one spec_round per round, worker server
spans under the right round, the caller's traceparent honoured; and the env-var set-up."""

from __future__ import annotations

import re
import time

import grpc
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import StatusCode

from specd.observability import telemetry
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, running_stack
from tests.stack import coordinator_settings, slow_verify, wait_for
from tests.tracing import ROLES, in_memory_tracing

OTEL_VARS = (
    "OTEL_SERVICE_NAME",
    "OTEL_RESOURCE_ATTRIBUTES",
    "OTEL_SDK_DISABLED",
    "OTEL_TRACES_EXPORTER",
    "OTEL_EXPORTER_OTLP_ENDPOINT",
    "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT",
    "OTEL_TRACES_SAMPLER",
    "OTEL_TRACES_SAMPLER_ARG",
)


@pytest.fixture
def clean_env(monkeypatch):
    for name in OTEL_VARS:
        monkeypatch.delenv(name, raising=False)
    return monkeypatch


@pytest.fixture(scope="module")
def traced(tiny_pair):
    """The three services, each exporting to its own in-memory exporter."""
    providers, exporters = in_memory_tracing()
    with running_stack(*tiny_pair, tracer_providers=providers) as stack:
        yield stack, exporters


def _request(max_new_tokens: int = 12, k: int = 3) -> pb.GenerateRequest:
    return pb.GenerateRequest(
        prompt="def add(a, b):",
        max_new_tokens=max_new_tokens,
        ignore_eos=True,
        speculation=pb.SpeculationParams(mode=pb.SPECULATION_MODE_SD, num_speculative_tokens=k),
    )


def _spans(exporters, trace_id: str) -> dict[str, list]:
    """The finished spans of one trace, by service (EndSession calls may still be in flight)."""
    return {
        role: [s for s in exporters[role].get_finished_spans() if trace.format_trace_id(s.context.trace_id) == trace_id]
        for role in ROLES
    }


def _settled_spans(exporters, trace_id: str, timeout_s: float = 5.0) -> dict[str, list]:
    """The trace's finished spans once every parent they name has finished too, or at the
    deadline. A parent can end after its children and after the response reaches the caller:
    the coordinator's client span of an EndSession after the worker's server span, the
    request's last spec_rounds summary after its final round."""
    wait_for(lambda: _parents_finished(_spans(exporters, trace_id)), timeout_s, every_s=0.05)
    return _spans(exporters, trace_id)


def _parents_finished(spans: dict[str, list]) -> bool:
    finished = [s for role in ROLES for s in spans[role]]
    ids = {s.context.span_id for s in finished}
    return all(s.parent is None or s.parent.span_id in ids for s in finished)


def _ancestors(span, by_id) -> list:
    chain = []
    while span.parent is not None and span.parent.span_id in by_id:
        span = by_id[span.parent.span_id]
        chain.append(span)
    return chain


def test_one_trace_across_three_services(traced):
    stack, exporters = traced
    for exporter in exporters.values():
        exporter.clear()
    response = stack.stub().Generate(_request(), timeout=CALL_TIMEOUT_S)
    assert re.fullmatch(r"[0-9a-f]{32}", response.trace_id)
    assert {trace.format_trace_id(s.context.trace_id) for e in exporters.values() for s in e.get_finished_spans()} == {
        response.trace_id
    }
    spans = _settled_spans(exporters, response.trace_id)
    for role in ROLES:
        assert {s.resource.attributes["service.name"] for s in spans[role]} == {telemetry.SERVICE_NAMES[role]}
    by_id = {s.context.span_id: s for role in ROLES for s in spans[role]}

    (root,) = [s for s in spans["coordinator"] if s.name == "llm_request"]
    assert root.kind == trace.SpanKind.SERVER and root.parent is None
    a = root.attributes
    assert a["gen_ai.request.max_tokens"] == 12 and a["gen_ai.usage.output_tokens"] == 12
    assert a["gen_ai.usage.input_tokens"] == response.usage.prompt_tokens
    assert a["gen_ai.response.finish_reasons"] == ("length",)
    assert a["gen_ai.response.id"] == response.request_id
    assert a["gen_ai.request.temperature"] == 0.0 and "gen_ai.request.top_p" in a and "gen_ai.request.top_k" in a
    assert a["specd.accepted_tokens"] == response.stats.accepted_tokens and a["specd.rounds"] == response.stats.rounds
    assert 0 < a["specd.ttft_ms"] <= a["specd.e2e_ms"]

    rounds = sorted((s for s in spans["coordinator"] if s.name == "spec_round"), key=lambda s: s.attributes["specd.round.index"])
    assert [s.attributes["specd.round.index"] for s in rounds] == list(range(response.stats.rounds))
    assert all(s.parent.span_id == root.context.span_id for s in rounds)
    assert sum(s.attributes["specd.round.accepted"] for s in rounds) == response.stats.accepted_tokens
    assert sum(s.attributes["specd.round.num_draft"] for s in rounds) == response.stats.draft_tokens
    for s in rounds:  # the last round has room for no draft: a plain decode step
        assert s.attributes["specd.round.mode"] == ("sd" if s.attributes["specd.round.num_draft"] else "off")
        assert s.attributes["specd.round.next_token_kind"] in ("bonus", "recovered")
        assert s.attributes["specd.round.verify_ms"] > 0
        assert (s.attributes["specd.round.draft_wait_ms"] > 0) == (s.attributes["specd.round.num_draft"] > 0)

    # Each round's Verify (target) and Propose (draft) server spans hang under that round.
    round_ids = {s.context.span_id for s in rounds}
    drafted_ids = {s.context.span_id for s in rounds if s.attributes["specd.round.num_draft"]}
    for role, method, inner, owners_expected in (
        ("target", "Verify", "spec_verify", round_ids),
        ("draft", "Propose", "spec_propose", drafted_ids),
    ):
        servers = [s for s in spans[role] if s.name.endswith(f"/{method}")]
        owners = []
        for server in servers:
            assert server.kind == trace.SpanKind.SERVER
            owners.append(next(a.context.span_id for a in _ancestors(server, by_id) if a.context.span_id in round_ids))
        assert sorted(owners) == sorted(owners_expected), role  # exactly one per round that made the call
        inner_spans = [s for s in spans[role] if s.name == inner]
        assert {s.parent.span_id for s in inner_spans} == {s.context.span_id for s in servers}
    verifies = [s for s in spans["target"] if s.name == "spec_verify"]
    assert all(s.attributes["specd.forward_ms"] > 0 and s.attributes["specd.tokens_verified"] >= 1 for s in verifies)
    # Health checks never make spans.
    assert not any("Health" in s.name for e in exporters.values() for s in e.get_finished_spans())


def test_caller_traceparent_and_stream_trace_ids(traced):
    stack, exporters = traced
    caller_trace, caller_span = "4bf92f3577b34da6a3ce929d0e0e4736", "00f067aa0ba902b7"
    metadata = [("traceparent", f"00-{caller_trace}-{caller_span}-01")]
    response = stack.stub().Generate(_request(6), timeout=CALL_TIMEOUT_S, metadata=metadata)
    assert response.trace_id == caller_trace
    (root,) = [s for s in _spans(exporters, caller_trace)["coordinator"] if s.name == "llm_request"]
    assert root.parent.is_remote and f"{root.parent.span_id:016x}" == caller_span

    messages = list(stack.stub().GenerateStream(_request(6), timeout=CALL_TIMEOUT_S))
    ids = {m.trace_id for m in messages}
    assert len(messages) >= 2 and len(ids) == 1 and re.fullmatch(r"[0-9a-f]{32}", ids.pop())


def test_a_refused_request_is_an_error_span_with_its_status(traced):
    stack, exporters = traced
    exporters["coordinator"].clear()
    with pytest.raises(grpc.RpcError) as refused:
        stack.stub().Generate(pb.GenerateRequest(prompt=""), timeout=CALL_TIMEOUT_S)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    deadline = time.monotonic() + 5  # the status may reach the caller before the span ends
    while not (roots := [s for s in exporters["coordinator"].get_finished_spans() if s.name == "llm_request"]):
        assert time.monotonic() < deadline, "no llm_request span"
        time.sleep(0.05)
    (root,) = roots
    assert root.status.status_code == StatusCode.ERROR and "prompt" in root.status.description
    assert root.attributes["rpc.grpc.status_code"] == grpc.StatusCode.INVALID_ARGUMENT.value[0]


def test_rounds_past_the_cap_fold_into_summary_spans(traced):
    stack, exporters = traced
    with coordinator_settings(stack.coordinator.servicer, trace_max_round_spans=3):
        response = stack.stub().Generate(_request(14, k=1), timeout=CALL_TIMEOUT_S)
    spans = _settled_spans(exporters, response.trace_id)
    assert response.stats.rounds > 6
    coordinator = spans["coordinator"]
    assert len([s for s in coordinator if s.name == "spec_round"]) == 3
    summaries = [s for s in coordinator if s.name == "spec_rounds"]
    assert sum(s.attributes["specd.rounds.rounds"] for s in summaries) == response.stats.rounds - 3
    assert all(s.attributes["specd.rounds.rounds"] <= 3 for s in summaries)
    accepted = sum(s.attributes["specd.round.accepted"] for s in coordinator if s.name == "spec_round")
    accepted += sum(s.attributes["specd.rounds.accepted"] for s in summaries)
    assert accepted == response.stats.accepted_tokens
    # No worker span loses its parent: every parent within the trace exists.
    all_spans = [s for role in ROLES for s in spans[role]]
    ids = {s.context.span_id for s in all_spans}
    assert all(s.parent is None or s.parent.span_id in ids for s in all_spans)
    verifies = [s for s in spans["target"] if s.name.endswith("/Verify")]
    assert len(verifies) == response.stats.rounds


def test_env_decides_exporter_sampler_and_service_name(clean_env):
    provider = telemetry.tracer_provider_from_env("specd-target")
    assert provider.resource.attributes["service.name"] == "specd-target"
    with telemetry.get_tracer(provider).start_as_current_span("x") as span:
        # No exporter: nothing is recorded, yet the request still gets a real trace id.
        assert not span.is_recording() and re.fullmatch(r"[0-9a-f]{32}", telemetry.trace_id_hex(span))
    assert telemetry.trace_id_hex(trace.INVALID_SPAN) == ""

    clean_env.setenv("OTEL_RESOURCE_ATTRIBUTES", "service.name=from-attrs,deployment.environment=test")
    assert telemetry.resource_from_env("specd-draft").attributes["service.name"] == "from-attrs"
    clean_env.setenv("OTEL_SERVICE_NAME", "mine")
    assert telemetry.resource_from_env("specd-draft").attributes["service.name"] == "mine"

    clean_env.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:1")
    clean_env.setenv("OTEL_TRACES_SAMPLER", "traceidratio")
    clean_env.setenv("OTEL_TRACES_SAMPLER_ARG", "1.0")
    provider = telemetry.tracer_provider_from_env("specd-coordinator")
    processors = provider._active_span_processor._span_processors
    assert [type(p) for p in processors] == [BatchSpanProcessor]
    assert type(processors[0].span_exporter).__module__.startswith("opentelemetry.exporter.otlp.proto.grpc")
    assert "TraceIdRatio" in provider.sampler.get_description()
    provider.shutdown()

    clean_env.setenv("OTEL_TRACES_EXPORTER", "none")
    assert telemetry.exporter_names() == []
    clean_env.setenv("OTEL_SDK_DISABLED", "true")
    disabled = telemetry.tracer_provider_from_env("specd-coordinator")
    assert isinstance(disabled, trace.NoOpTracerProvider)
    assert telemetry.server_interceptors(disabled) == [] and telemetry.client_interceptors(disabled) == []
    with telemetry.get_tracer(disabled).start_as_current_span("x") as span:
        assert telemetry.trace_id_hex(span) == ""


def test_rounds_past_the_limit_fold_into_summary_spans_under_the_request():
    from coordinator.round_trace import RoundTrace

    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")
    with tracer.start_as_current_span("llm_request") as request:
        rounds = RoundTrace(tracer, max_round_spans=1)
        for index in range(3):
            with rounds.round(index):
                with tracer.start_as_current_span("worker_call"):
                    pass
        rounds.close()
        rounds.close()  # idempotent
    spans = {s.name: s for s in exporter.get_finished_spans()}
    request_id = request.get_span_context().span_id
    assert spans["spec_round"].parent.span_id == request_id
    summary = [s for s in exporter.get_finished_spans() if s.name == "spec_rounds"]
    assert [s.attributes["specd.rounds.rounds"] for s in summary] == [1, 1]  # groups of max_round_spans
    assert all(s.parent.span_id == request_id for s in summary)
    calls = [s for s in exporter.get_finished_spans() if s.name == "worker_call"]
    parents = {s.parent.span_id for s in calls}
    assert parents == {spans["spec_round"].context.span_id} | {s.context.span_id for s in summary}


def test_without_an_exporter_calls_carry_the_traceparent_themselves(clean_env):
    # No exporter: spans only carry ids, so no gRPC interceptors (they cost every call), and a
    # worker call made inside a request carries the request's traceparent as plain metadata.
    idle = telemetry.tracer_provider_from_env("specd-coordinator")
    assert not telemetry.records_spans(idle)
    assert telemetry.server_interceptors(idle) == [] and telemetry.client_interceptors(idle) == []
    with telemetry.get_tracer(idle).start_as_current_span("llm_request") as span:
        metadata = dict(telemetry.trace_metadata())
        assert metadata["traceparent"].split("-")[1] == telemetry.trace_id_hex(span) != ""
    assert telemetry.trace_metadata() == ()  # outside a request (start-up probes): nothing
    recording = TracerProvider()
    assert telemetry.records_spans(recording) and telemetry.client_interceptors(recording)
    assert telemetry.server_interceptors(recording)


@pytest.mark.parametrize(
    "overrides, reasons",
    [
        # No cache is ever built: every lookup after round 0 misses, for that reason alone.
        (dict(ssd_budget=0, ssd_backup="jit"), {"no_speculation"}),
        # A cache built and waited for: a miss can only be an outcome it did not cover.
        (dict(ssd_budget=16, ssd_backup="jit"), {"uncovered"}),
    ],
)
def test_ssd_rounds_say_why_a_lookup_missed(traced, overrides, reasons):
    stack, exporters = traced
    with coordinator_settings(stack.coordinator.servicer, **overrides):
        ssd = _request(24)
        ssd.speculation.mode = pb.SPECULATION_MODE_SSD
        response = stack.stub().Generate(ssd, timeout=CALL_TIMEOUT_S)
    assert response.stats.mode == pb.SPECULATION_MODE_SSD
    rounds = [s for s in _spans(exporters, response.trace_id)["coordinator"] if s.name == "spec_round"]
    misses = [s for s in rounds if s.attributes.get("specd.round.cache") == "miss"]
    assert len(misses) == response.stats.cache_misses
    assert {s.attributes["specd.round.miss"] for s in misses} <= reasons
    assert not any("specd.round.miss" in s.attributes for s in rounds if s not in misses)
    if "no_speculation" in reasons:
        assert misses and response.stats.cache_hits == 0


def test_a_verify_sent_ahead_has_its_span_under_its_call(traced):
    """The target runs a chosen verify from its model thread; its spec_verify span still sits
    under the VerifyAfter call, at the times the forward ran."""
    stack, exporters = traced
    runner = stack.target.servicer.runner
    slow_verify(runner, 0.05)  # slower than the tiny draft's tree build: caches arrive in time
    try:
        with coordinator_settings(stack.coordinator.servicer, ssd_budget=16, ssd_backup="jit"):
            ssd = _request(24)
            ssd.speculation.mode = pb.SPECULATION_MODE_SSD
            response = stack.stub().Generate(ssd, timeout=CALL_TIMEOUT_S)
    finally:
        del runner.run_batch  # the class's own again
    assert response.stats.verified_ahead > 0
    target = _spans(exporters, response.trace_id)["target"]
    calls = {s.context.span_id: s for s in target if s.name.endswith("/VerifyAfter")}
    inner = [s for s in target if s.name == "spec_verify" and s.parent.span_id in calls]
    assert len(inner) >= response.stats.verified_ahead
    for span in inner:
        call = calls[span.parent.span_id]
        assert call.start_time <= span.start_time < span.end_time <= call.end_time
        assert span.attributes["specd.forward_ms"] > 0 and span.attributes["specd.tokens_verified"] >= 2
