"""OpenTelemetry for the three services, configured only by the standard environment variables.

Each service builds its own TracerProvider (`tracer_provider_from_env`) and passes it to its
interceptors and span code, so three services in one process (the tests) keep apart.

What the environment decides:

- OTEL_SDK_DISABLED=true: a no-op provider; no spans, no trace ids (responses carry "").
- An exporter is configured when OTEL_TRACES_EXPORTER names one (otlp, console; "none" for
  none) or, when it is unset, when OTEL_EXPORTER_OTLP_ENDPOINT or
  OTEL_EXPORTER_OTLP_TRACES_ENDPOINT is set (then otlp). OTEL_EXPORTER_OTLP_PROTOCOL picks
  grpc (default) or http/protobuf.
- With no exporter the sampler is always_off: spans are not recorded (near-zero cost) but
  every request still gets a real trace id, which callers can log and correlate. With an
  exporter, OTEL_TRACES_SAMPLER / OTEL_TRACES_SAMPLER_ARG apply (default parentbased_always_on).
- service.name: OTEL_SERVICE_NAME, else service.name in OTEL_RESOURCE_ATTRIBUTES, else the
  service's default (specd-coordinator, specd-target, specd-draft).
"""

from __future__ import annotations

import contextlib
import inspect
import os
import time
from typing import Iterator, Mapping

import grpc
from opentelemetry import propagate, trace
from opentelemetry.context import Context
from opentelemetry.sdk.resources import OTELResourceDetector, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.sdk.trace.sampling import ALWAYS_OFF

from specd.core.config import ConfigError

SERVICE_NAMES = {"coordinator": "specd-coordinator", "target": "specd-target", "draft": "specd-draft"}
INSTRUMENTATION = "specd"

# Calls that never make spans: health probes and reflection would drown the real traffic.
_UNTRACED_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.")


def _truthy(value: str | None) -> bool:
    return (value or "").strip().lower() in ("1", "true", "yes", "on")


def exporter_names(environ: Mapping[str, str] = os.environ) -> list[str]:
    """The span exporters the environment asks for ([] when tracing has nowhere to go)."""
    names = [n.strip().lower() for n in environ.get("OTEL_TRACES_EXPORTER", "").split(",") if n.strip()]
    if not names:
        endpoint = environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
        names = ["otlp"] if endpoint else []
    return [n for n in names if n != "none"]


def _exporter(name: str, environ: Mapping[str, str] = os.environ):
    if name == "console":
        return ConsoleSpanExporter()
    if name != "otlp":
        raise ConfigError(f"OTEL_TRACES_EXPORTER={name!r}: specd supports otlp, console and none")
    protocol = (
        environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or environ.get("OTEL_EXPORTER_OTLP_PROTOCOL") or "grpc"
    ).strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise ConfigError(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc or http/protobuf")
    return OTLPSpanExporter()  # endpoint, headers, timeout, insecure: from the standard env vars


def resource_from_env(default_service_name: str) -> Resource:
    detected = OTELResourceDetector().detect()
    resource = Resource.create()
    if "service.name" not in detected.attributes:
        resource = resource.merge(Resource({"service.name": default_service_name}))
    return resource


def tracer_provider_from_env(default_service_name: str) -> trace.TracerProvider:
    """A provider for one service, as the standard OTEL_* variables describe (module doc).

    To toggle tracing (e.g. in a benchmark), set the variables before calling this."""
    if _truthy(os.environ.get("OTEL_SDK_DISABLED")):
        return trace.NoOpTracerProvider()
    names = exporter_names()
    # TracerProvider reads OTEL_TRACES_SAMPLER(_ARG) itself when no sampler is given.
    provider = TracerProvider(resource=resource_from_env(default_service_name), sampler=None if names else ALWAYS_OFF)
    for name in names:
        provider.add_span_processor(BatchSpanProcessor(_exporter(name)))
    return provider


def get_tracer(provider: trace.TracerProvider | None) -> trace.Tracer:
    return (provider or trace.NoOpTracerProvider()).get_tracer(INSTRUMENTATION)


def _traced_call(details) -> bool:
    method = getattr(details, "method", "")
    if isinstance(method, bytes):
        method = method.decode()
    return not any(method.lstrip("/").startswith(s) for s in _UNTRACED_SERVICES)


def _traced_server_call(details) -> bool:
    # A worker's Info answered outside any trace (the coordinator's start-up probes) makes
    # no trace of its own; every other call is traced.
    if not _traced_call(details):
        return False
    method = details.method.decode() if isinstance(details.method, bytes) else details.method
    if method.endswith("/Info"):
        return any(key == "traceparent" for key, _ in details.invocation_metadata or ())
    return True


def _traced_worker_call(details) -> bool:
    # Worker calls outside a request (start-up Info probes) would each start a trace of their own.
    return _traced_call(details) and trace.get_current_span().get_span_context().is_valid


def records_spans(provider: trace.TracerProvider | None) -> bool:
    """Whether `provider` records spans: it does when an exporter is configured. Without one
    (sampler always_off) a span only carries ids, and gRPC interceptors would add work to
    every call for spans nobody sees (docs/observability.md has the measurement)."""
    return isinstance(provider, TracerProvider) and provider.sampler is not ALWAYS_OFF


def server_interceptors(provider: trace.TracerProvider | None) -> list:
    """The aio server interceptor: a SERVER span per RPC, joined to the caller's traceparent
    (behind _StreamsClosedInTask, which must wrap it: see there)."""
    if not records_spans(provider):
        return []
    from opentelemetry.instrumentation.grpc import aio_server_interceptor

    return [_StreamsClosedInTask(), aio_server_interceptor(tracer_provider=provider, filter_=_traced_server_call)]


class _StreamsClosedInTask(grpc.aio.ServerInterceptor):
    """Serve a streaming handler's responses with context.write and close its generator in the
    RPC's own task.

    The instrumentation's stream interceptor keeps its span current across its generator's
    yields. grpc drives a generator handler from the RPC's task; a caller that cancels while a
    response is being written cancels that task and leaves the generator at its yield, and
    asyncio closes it later from another task, whose Context cannot detach what was attached
    ("Failed to detach context" on every such cancelled stream). Here the generator is closed
    in the task that ran it, so its context is detached where it was attached.
    """

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler.response_streaming:
            return handler
        streaming = handler.unary_stream or handler.stream_stream

        async def written(request, context):
            responses = streaming(request, context)
            if not inspect.isasyncgen(responses):
                return await responses  # a handler that writes for itself
            try:
                async for response in responses:
                    await context.write(response)
            finally:
                await responses.aclose()

        make = grpc.unary_stream_rpc_method_handler if handler.unary_stream else grpc.stream_stream_rpc_method_handler
        return make(written, request_deserializer=handler.request_deserializer,
                    response_serializer=handler.response_serializer)


def client_interceptors(provider: trace.TracerProvider | None) -> list:
    """The aio client interceptors: a CLIENT span per worker call made inside a traced request.
    None when the provider records nothing: then trace_metadata() carries the traceparent."""
    if not records_spans(provider):
        return []
    from opentelemetry.instrumentation.grpc import aio_client_interceptors

    return aio_client_interceptors(tracer_provider=provider, filter_=_traced_worker_call)


def trace_metadata() -> tuple[tuple[str, str], ...]:
    """The current trace context as gRPC metadata (W3C traceparent), for calls made without
    the client interceptors: a worker that exports spans still joins the request's trace."""
    carrier: dict[str, str] = {}
    propagate.inject(carrier)
    return tuple(carrier.items())


def context_from_metadata(metadata) -> Context:
    """The caller's trace context (W3C traceparent/tracestate) from gRPC invocation metadata."""
    carrier: dict[str, str] = {}
    for key, value in metadata or ():
        if isinstance(value, str):
            carrier[key.lower()] = value
    return propagate.extract(carrier)


def trace_id_hex(span: trace.Span) -> str:
    """32 lower-case hex characters, or "" when tracing is disabled."""
    context = span.get_span_context()
    return trace.format_trace_id(context.trace_id) if context.is_valid else ""


@contextlib.contextmanager
def worker_span(tracer: trace.Tracer, name: str, **attributes) -> Iterator[trace.Span]:
    """An INTERNAL span on a worker (spec_verify, spec_propose, spec_speculate); attributes
    are given without their `specd.` prefix."""
    with tracer.start_as_current_span(name) as span:
        if span.is_recording():
            span.set_attributes({f"specd.{k}": v for k, v in attributes.items()})
        yield span


def set_specd(span: trace.Span, **attributes) -> None:
    """Set `specd.<name>` attributes, skipping work when the span is not recorded."""
    if span.is_recording():
        span.set_attributes({f"specd.{k}": v for k, v in attributes.items() if v is not None})


def span_overhead_us(provider: trace.TracerProvider, spans: int = 2000) -> float:
    """Mean microseconds to start, annotate and end one round-like span with `provider`:
    a quick way for `specd bench` to show what tracing costs (compare a provider from
    tracer_provider_from_env with tracing on against one with it off)."""
    tracer = get_tracer(provider)
    started = time.perf_counter()
    for i in range(spans):
        with tracer.start_as_current_span("spec_round") as span:
            set_specd(span, round_index=i, mode="sd", num_draft=4, accepted=2, draft_wait_ms=1.0)
    return (time.perf_counter() - started) / spans * 1e6
