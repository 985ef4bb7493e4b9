"""Spans without Jaeger: a tiny OTLP gRPC receiver that stores spans as JSON lines, and a
reader for those lines and for OTLP JSON exports (ExportTraceServiceRequest objects, one per
line or one per file, as the OpenTelemetry collector's file exporter writes them).

A stored span is one flat JSON object per line:
    {"trace_id": hex32, "span_id": hex16, "parent_span_id": hex16 or "", "name": str,
     "kind": "SERVER"|..., "service": str, "start_ns": int, "end_ns": int,
     "attributes": {...}, "links": [{"trace_id", "span_id", "attributes"}]}
"""

from __future__ import annotations

import base64
import json
import pathlib
import threading
from concurrent import futures

import grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1 import common_pb2
from opentelemetry.proto.trace.v1 import trace_pb2

from specd.serving.ports import add_port

_KINDS = {v: k.removeprefix("SPAN_KIND_") for k, v in trace_pb2.Span.SpanKind.items()}


def _value(any_value: common_pb2.AnyValue):
    which = any_value.WhichOneof("value")
    if which == "array_value":
        return [_value(v) for v in any_value.array_value.values]
    if which == "kvlist_value":
        return {kv.key: _value(kv.value) for kv in any_value.kvlist_value.values}
    if which == "bytes_value":
        return any_value.bytes_value.hex()
    return getattr(any_value, which) if which else None


def _attributes(key_values) -> dict:
    return {kv.key: _value(kv.value) for kv in key_values}


def spans_from_request(request: trace_service_pb2.ExportTraceServiceRequest) -> list[dict]:
    spans = []
    for resource_spans in request.resource_spans:
        service = _attributes(resource_spans.resource.attributes).get("service.name", "")
        for scope_spans in resource_spans.scope_spans:
            for span in scope_spans.spans:
                spans.append(
                    {
                        "trace_id": span.trace_id.hex(),
                        "span_id": span.span_id.hex(),
                        "parent_span_id": span.parent_span_id.hex(),
                        "name": span.name,
                        "kind": _KINDS.get(span.kind, "UNSPECIFIED"),
                        "service": service,
                        "start_ns": span.start_time_unix_nano,
                        "end_ns": span.end_time_unix_nano,
                        "attributes": _attributes(span.attributes),
                        "links": [
                            {"trace_id": l.trace_id.hex(), "span_id": l.span_id.hex(), "attributes": _attributes(l.attributes)}
                            for l in span.links
                        ],
                    }
                )
    return spans


class _TraceService(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, path: pathlib.Path):
        self._path = path
        self._lock = threading.Lock()
        self.received = 0

    def Export(self, request, context):
        spans = spans_from_request(request)
        with self._lock, self._path.open("a") as out:
            for span in spans:
                out.write(json.dumps(span) + "\n")
            self.received += len(spans)
        return trace_service_pb2.ExportTraceServiceResponse()


class Receiver:
    """An OTLP gRPC trace receiver on host:port (0: a free port) appending to a JSON-lines file."""

    def __init__(self, path: str | pathlib.Path, host: str = "127.0.0.1", port: int = 4317):
        self.path = pathlib.Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()
        self.service = _TraceService(self.path)
        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=4), options=[("grpc.so_reuseport", 0)])  # never shares its port
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(self.service, self.server)
        self.port = add_port(self.server, f"{host}:{port}")
        self.host = host

    @property
    def endpoint(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> "Receiver":
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(0)


# --- reading -----------------------------------------------------------------------------


def _otlp_json_id(value: str) -> str:
    """OTLP/JSON ids are hex; tolerate protobuf-JSON's base64 too."""
    if not value:
        return ""
    if len(value) in (16, 32) and all(c in "0123456789abcdefABCDEF" for c in value):
        return value.lower()
    return base64.b64decode(value).hex()


def _otlp_json_value(value: dict):
    if not value:
        return None
    (kind, inner), = value.items()
    if kind == "arrayValue":
        return [_otlp_json_value(v) for v in inner.get("values", [])]
    if kind == "kvlistValue":
        return {kv["key"]: _otlp_json_value(kv.get("value", {})) for kv in inner.get("values", [])}
    if kind == "intValue":
        return int(inner)
    return inner


def _otlp_json_spans(document: dict) -> list[dict]:
    spans = []
    for resource_spans in document.get("resourceSpans", []):
        resource = {kv["key"]: _otlp_json_value(kv.get("value", {})) for kv in resource_spans.get("resource", {}).get("attributes", [])}
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                kind = span.get("kind", 0)
                spans.append(
                    {
                        "trace_id": _otlp_json_id(span.get("traceId", "")),
                        "span_id": _otlp_json_id(span.get("spanId", "")),
                        "parent_span_id": _otlp_json_id(span.get("parentSpanId", "")),
                        "name": span.get("name", ""),
                        "kind": _KINDS.get(kind, "UNSPECIFIED") if isinstance(kind, int) else str(kind).removeprefix("SPAN_KIND_"),
                        "service": resource.get("service.name", ""),
                        "start_ns": int(span.get("startTimeUnixNano", 0)),
                        "end_ns": int(span.get("endTimeUnixNano", 0)),
                        "attributes": {kv["key"]: _otlp_json_value(kv.get("value", {})) for kv in span.get("attributes", [])},
                        "links": [
                            {"trace_id": _otlp_json_id(l.get("traceId", "")), "span_id": _otlp_json_id(l.get("spanId", "")), "attributes": {}}
                            for l in span.get("links", [])
                        ],
                    }
                )
    return spans


def load_spans(path: str | pathlib.Path) -> list[dict]:
    """Spans from a stored JSON-lines file or an OTLP JSON export (either, one object per line
    or one whole document)."""
    text = pathlib.Path(path).read_text()
    try:
        documents = [json.loads(text)]
    except json.JSONDecodeError:
        documents = [json.loads(line) for line in text.splitlines() if line.strip()]
    spans: list[dict] = []
    for document in documents:
        if isinstance(document, list):
            spans.extend(document)
        elif "resourceSpans" in document:
            spans.extend(_otlp_json_spans(document))
        elif "trace_id" in document:
            spans.append(document)
    return spans


def trace_spans(spans: list[dict], trace_id: str | None = None) -> list[dict]:
    """The spans of one trace: `trace_id`, or the latest trace that has an llm_request."""
    if trace_id is None:
        roots = [s for s in spans if s["name"] == "llm_request"]
        if not roots:
            raise LookupError("no llm_request span in these spans; give a trace id")
        trace_id = max(roots, key=lambda s: s["start_ns"])["trace_id"]
    trace_id = trace_id.lower()
    found = [s for s in spans if s["trace_id"] == trace_id]
    if not found:
        raise LookupError(f"no spans of trace {trace_id}")
    return found
