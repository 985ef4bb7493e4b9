"""Tracer providers for the tests: one per service, each exporting to its own in-memory
exporter, so that three services in one process keep their spans and service names apart."""

from __future__ import annotations

from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from specd.observability import telemetry

ROLES = ("coordinator", "target", "draft")


def in_memory_tracing() -> tuple[dict[str, TracerProvider], dict[str, InMemorySpanExporter]]:
    """(providers, exporters) by role, for running_stack(..., tracer_providers=providers)."""
    exporters = {role: InMemorySpanExporter() for role in ROLES}
    providers = {}
    for role in ROLES:
        providers[role] = TracerProvider(resource=telemetry.resource_from_env(telemetry.SERVICE_NAMES[role]))
        providers[role].add_span_processor(SimpleSpanProcessor(exporters[role]))
    return providers, exporters


def round_attributes(exporter: InMemorySpanExporter, trace_id: str) -> list[dict]:
    """The attributes of each spec_round span the exporter holds for one request (its response's
    hex trace_id), in the order they ended."""
    wanted = int(trace_id, 16)
    return [dict(s.attributes) for s in exporter.get_finished_spans() if s.name == "spec_round" and s.context.trace_id == wanted]
