"""End to end: the three services (`specd serve` processes) export OTLP to a receiver the test starts on
loopback; the whole trace is found there by the trace id the client got back, and
`specd trace` draws it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from specd.cli import main
from specd.cli.trace_store import Receiver, load_spans, trace_spans
from specd.cli.up import free_port, wait_serving

SERVICES = {"specd-coordinator", "specd-target", "specd-draft"}


def _wait_for(predicate, timeout_s: float, what: str):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


def _serve(role: str, port: int, flags: list[str], env: dict, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "specd", "serve", role, "--host", "127.0.0.1", "--port", str(port), "--metrics-port", "-1", *flags],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
    )


@pytest.mark.slow
def test_served_stack_exports_the_whole_trace(tiny_pair, tmp_path, capsys):
    target, draft = tiny_pair
    receiver = Receiver(tmp_path / "spans.jsonl", port=0).start()
    env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
    env.update(OTEL_EXPORTER_OTLP_ENDPOINT=receiver.endpoint, OTEL_BSP_SCHEDULE_DELAY="100")
    ports = {role: free_port("127.0.0.1") for role in ("target", "draft", "coordinator")}
    worker = ["--device", "cpu", "--threads", "1"]
    log = (tmp_path / "services.log").open("wb")
    # All three start at once (the coordinator waits for the target itself): imports dominate here.
    processes = [
        _serve("target", ports["target"], ["--model", target, *worker], env, log),
        _serve("draft", ports["draft"], ["--model", draft, *worker], env, log),
        _serve("coordinator", ports["coordinator"], ["--target-address", f"127.0.0.1:{ports['target']}",
               "--draft-address", f"127.0.0.1:{ports['draft']}", "--http-port", "-1"], env, log),
    ]
    try:
        address = f"127.0.0.1:{ports['coordinator']}"
        deadline = time.monotonic() + 90
        for role in ("target", "draft"):  # so the request speculates from its first round
            wait_serving(f"127.0.0.1:{ports[role]}", processes[0 if role == "target" else 1], role, tmp_path / "services.log", deadline)
        wait_serving(address, processes[2], "coordinator", tmp_path / "services.log", deadline)
        generate = subprocess.run(
            [sys.executable, "-m", "specd", "generate", "def add(a, b):", "--address", address, "--json",
             "--max-new-tokens", "10", "--ignore-eos", "--mode", "sd", "-k", "3", "--timeout", "60"],
            capture_output=True, text=True, env=env, timeout=90,
        )
        assert generate.returncode == 0, generate.stderr
        result = json.loads(generate.stdout)
        trace_id = result["trace_id"]
        assert len(trace_id) == 32 and trace_id == trace_id.lower() and int(trace_id, 16)

        def whole_trace():
            spans = [s for s in load_spans(receiver.path) if s["trace_id"] == trace_id]
            names = {s["name"] for s in spans}
            complete = {s["service"] for s in spans} == SERVICES and {"llm_request", "spec_verify", "spec_propose"} <= names
            rounds = sum(s["name"] == "spec_round" for s in spans)
            # Spans arrive in per-service batches: a worker's span may land before its parent,
            # the coordinator's client span, so wait until every parent has arrived too.
            ids = {s["span_id"] for s in spans}
            parents_in = all(not s["parent_span_id"] or s["parent_span_id"] in ids for s in spans)
            return spans if complete and parents_in and rounds == result["stats"]["rounds"] else None

        spans = _wait_for(whole_trace, 20.0, "the trace at the receiver")
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(timeout=30)
        receiver.stop()
    (root,) = [s for s in spans if s["name"] == "llm_request"]
    assert root["service"] == "specd-coordinator" and root["kind"] == "SERVER" and not root["parent_span_id"]
    assert root["attributes"]["gen_ai.usage.output_tokens"] == 10
    ids = {s["span_id"] for s in spans}
    assert all(not s["parent_span_id"] or s["parent_span_id"] in ids for s in spans)

    output = tmp_path / "trace.png"
    assert main(["trace", trace_id, "--spans", str(receiver.path), "-o", str(output)]) == 0
    assert output.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "target verifying" in capsys.readouterr().out  # the occupancy summary: verifies were found
    assert trace_spans(load_spans(receiver.path), None)[0]["trace_id"] == trace_id  # latest request by default


def test_reads_otlp_json_exports(tmp_path):
    from google.protobuf import json_format
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2
    from opentelemetry.proto.common.v1 import common_pb2
    from opentelemetry.proto.trace.v1 import trace_pb2

    from specd.cli.trace_store import spans_from_request

    def kv(key, **value):
        return common_pb2.KeyValue(key=key, value=common_pb2.AnyValue(**value))

    trace_id, root_id = bytes(range(16)), bytes(range(8))
    root = trace_pb2.Span(trace_id=trace_id, span_id=root_id, name="llm_request", kind=trace_pb2.Span.SPAN_KIND_SERVER,
                          start_time_unix_nano=1_000_000, end_time_unix_nano=9_000_000,
                          attributes=[kv("gen_ai.usage.output_tokens", int_value=5)])
    round_span = trace_pb2.Span(trace_id=trace_id, span_id=bytes(range(1, 9)), parent_span_id=root_id, name="spec_round",
                                start_time_unix_nano=2_000_000, end_time_unix_nano=4_000_000,
                                attributes=[kv("specd.round.index", int_value=0), kv("specd.round.cache", string_value="hit")])
    request = trace_service_pb2.ExportTraceServiceRequest(resource_spans=[trace_pb2.ResourceSpans(
        resource={"attributes": [kv("service.name", string_value="specd-coordinator")]},
        scope_spans=[trace_pb2.ScopeSpans(spans=[root, round_span])],
    )])
    expected = spans_from_request(request)
    as_protobuf_json = json_format.MessageToJson(request)  # ids in base64
    document = json_format.MessageToDict(request)  # OTLP/JSON proper: ids in hex
    for span, proto_span in zip(document["resourceSpans"][0]["scopeSpans"][0]["spans"], (root, round_span)):
        span["traceId"], span["spanId"] = proto_span.trace_id.hex(), proto_span.span_id.hex()
        if proto_span.parent_span_id:
            span["parentSpanId"] = proto_span.parent_span_id.hex()
    for i, text in enumerate((as_protobuf_json, json.dumps(document))):
        path = tmp_path / f"export{i}.json"
        path.write_text(text)
        assert load_spans(path) == expected
    output = tmp_path / "t.png"
    assert main(["trace", str(tmp_path / "export1.json"), "-o", str(output)]) == 0
    assert output.read_bytes()[:4] == b"\x89PNG"


def test_target_occupancy_is_verify_time_over_the_rounds_time():
    from specd.cli.trace import target_occupancy

    ms = 1_000_000
    rounds = [{"start_ns": 0, "end_ns": 40 * ms}, {"start_ns": 40 * ms, "end_ns": 100 * ms}]
    verify = [(10 * ms, 30 * ms), (35 * ms, 55 * ms), (60 * ms, 90 * ms), (95 * ms, 120 * ms)]  # the last runs past the rounds
    busy, gap = target_occupancy(verify, rounds)
    assert busy == pytest.approx((20 + 20 + 30 + 5) / 100)
    assert gap == pytest.approx(5.0)  # gaps 5, 5, 5 ms
    assert target_occupancy([], rounds) is None and target_occupancy(verify, []) is None



def test_the_picture_says_which_mode_ran_and_names_its_markers(tmp_path):
    from specd.cli.trace import _legend, draw

    def span(name, start, end, parent="", **attributes):
        return {"trace_id": "ab" * 16, "span_id": f"{start:016x}", "parent_span_id": parent, "name": name,
                "kind": "INTERNAL", "service": "specd-coordinator", "start_ns": start * 1_000_000,
                "end_ns": end * 1_000_000, "attributes": attributes}

    root = span("llm_request", 0, 30, **{"specd.request.mode": "auto", "specd.mode": "ssd", "gen_ai.usage.output_tokens": 4})
    rounds = [
        span("spec_round", 1, 10, root["span_id"], **{"specd.round.index": 0, "specd.round.cache": "hit"}),
        span("spec_round", 11, 20, root["span_id"], **{"specd.round.index": 1, "specd.round.cache": "miss"}),
    ]
    summary = draw([root, *rounds], tmp_path / "t.png")
    assert summary.startswith(f"trace {'ab' * 16}, mode ssd:"), summary
    assert "cache 1 hits / 1 misses" in summary
    labels = [handle.get_label() for handle in _legend(rounds, hits=1, misses=1)]
    assert {"ssd cache hit", "ssd cache miss"} <= set(labels), labels
    assert not {"ssd cache hit", "ssd cache miss"} & {h.get_label() for h in _legend(rounds, hits=0, misses=0)}

    fell_back = dict(root, attributes={"specd.request.mode": "sd", "specd.mode": "off", "specd.fallback_reason": "draft unavailable"})
    assert ", mode off (fell back: draft unavailable):" in draw([fell_back], tmp_path / "u.png")
