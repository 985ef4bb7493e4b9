"""Time one round-like span with tracing disabled, on without an exporter, and exporting OTLP
to a loopback receiver (docs/observability.md, "What it costs")."""
import os
import tempfile

from opentelemetry import trace

from specd.cli.trace_store import Receiver
from specd.observability import telemetry

for k in list(os.environ):
    if k.startswith("OTEL_"): del os.environ[k]
r = Receiver(tempfile.mktemp(suffix=".jsonl"), port=0).start()
cases = {"sdk disabled": trace.NoOpTracerProvider(), "no exporter (ids only)": telemetry.tracer_provider_from_env("specd-coordinator")}
os.environ["OTEL_EXPORTER_OTLP_ENDPOINT"] = r.endpoint
cases["otlp export"] = telemetry.tracer_provider_from_env("specd-coordinator")
for name, p in cases.items():
    telemetry.span_overhead_us(p, 500)
    print(f"{name:24s} {min(telemetry.span_overhead_us(p, 5000) for _ in range(3)):.1f} us/span")
cases["otlp export"].shutdown(); r.stop()
