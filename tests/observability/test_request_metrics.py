"""Requests by outcome on a running stack: each request is counted once, by finish reason or by
the gRPC code it ended with, its tokens add up to the responses' usage, and it gets one log line
that never holds its text."""

from __future__ import annotations

import http.client
import json
import logging
import re
import urllib.error
import urllib.request

import grpc
import pytest

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, request, running_stack
from tests.observability.test_metrics import scrape
from tests.stack import verify_gate, wait_for

PROMPT = "zebra lantern quartz"  # appears in no log line
LOG_FIELDS = ("request_id", "mode", "status", "prompt_tokens", "generated_tokens", "rounds", "acceptance", "duration_ms", "trace_id")


@pytest.fixture(scope="module")
def stack(tiny_pair):
    with running_stack(*tiny_pair, coordinator_overrides={"metrics_port": 0}) as running:
        yield running


def _streamed(stub, message: pb.GenerateRequest) -> pb.GenerateStreamResponse:
    """The stream's last message (finish reason, usage)."""
    return list(stub.GenerateStream(message, timeout=CALL_TIMEOUT_S))[-1]


def _failed_with(call, code: grpc.StatusCode) -> None:
    with pytest.raises(grpc.RpcError) as raised:
        call()
    assert raised.value.code() == code


def _deadline_passes_mid_request(stack, stub) -> None:
    gate = verify_gate(stack.target.servicer.runner)  # the request is held in its rounds
    try:
        message = request(prompt=PROMPT, max_new_tokens=200, request_id="deadline")
        _failed_with(lambda: stub.Generate(message, timeout=0.5), grpc.StatusCode.DEADLINE_EXCEEDED)
    finally:
        gate.release()


def _cancelled_mid_stream(stub) -> None:
    call = stub.GenerateStream(request(prompt=PROMPT, max_new_tokens=200, request_id="cancelled"), timeout=CALL_TIMEOUT_S)
    next(call)  # running: its first tokens are out
    call.cancel()


def _log_lines(caplog) -> dict[str, dict[str, str]]:
    lines = [r.getMessage() for r in caplog.records if r.name == "coordinator.request_log"]
    parsed = [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines]
    by_id = {fields["request_id"]: fields for fields in parsed}
    assert len(by_id) == len(lines), f"a request logged more than once: {lines}"
    return by_id


def test_requests_are_counted_and_logged_once_by_outcome(stack, caplog):
    caplog.set_level(logging.INFO, logger="coordinator.request_log")
    stub = stack.stub()
    full = stub.Generate(request(prompt=PROMPT, max_new_tokens=24, request_id="length"), timeout=CALL_TIMEOUT_S)
    assert len(full.text) > 8
    stop = full.text[5:8]
    stopped = stub.Generate(request(prompt=PROMPT, max_new_tokens=24, stop=[stop], request_id="stop"), timeout=CALL_TIMEOUT_S)
    streamed = _streamed(stub, request(prompt=PROMPT, max_new_tokens=6, mode=pb.SPECULATION_MODE_OFF, request_id="stream"))
    finished = [full, stopped, streamed]
    assert [r.finish_reason for r in finished] == [pb.FINISH_REASON_LENGTH, pb.FINISH_REASON_STOP, pb.FINISH_REASON_LENGTH]
    bad = request(prompt=PROMPT, temperature=-1.0, request_id="invalid")
    _failed_with(lambda: stub.Generate(bad, timeout=CALL_TIMEOUT_S), grpc.StatusCode.INVALID_ARGUMENT)
    _deadline_passes_mid_request(stack, stub)
    _cancelled_mid_stream(stub)

    def count(name, **labels):
        return scrape(stack.coordinator.metrics.port).get((name, tuple(sorted(labels.items()))), 0)

    # The failed calls' handlers end after their callers have been told.
    assert wait_for(lambda: count("specd_request_failure_total", code="CANCELLED") == 1, 10.0)
    assert wait_for(lambda: count("specd_request_failure_total", code="DEADLINE_EXCEEDED") == 1, 10.0)
    metrics = scrape(stack.coordinator.metrics.port)
    failures = {dict(labels)["code"]: v for (name, labels), v in metrics.items() if name == "specd_request_failure_total"}
    assert failures == {"INVALID_ARGUMENT": 1, "DEADLINE_EXCEEDED": 1, "CANCELLED": 1}
    successes = {dict(labels)["finished_reason"]: v for (name, labels), v in metrics.items() if name == "specd_request_success_total"}
    assert successes == {"length": 2, "stop": 1}
    assert metrics[("specd_prompt_tokens_total", ())] == sum(r.usage.prompt_tokens for r in finished)
    assert metrics[("specd_generation_tokens_total", ())] == sum(r.usage.completion_tokens for r in finished)
    assert metrics[("specd_e2e_request_latency_seconds_count", ())] == len(finished)

    lines = _log_lines(caplog)
    assert set(lines) == {"length", "stop", "stream", "invalid", "deadline", "cancelled"}
    assert {request_id: fields["status"] for request_id, fields in lines.items()} == {
        "length": "length",
        "stop": "stop",
        "stream": "length",
        "invalid": "INVALID_ARGUMENT",
        "deadline": "DEADLINE_EXCEEDED",
        "cancelled": "CANCELLED",
    }
    for fields in lines.values():
        assert set(LOG_FIELDS) <= set(fields)
    assert lines["stop"]["generated_tokens"] == str(stopped.usage.completion_tokens)
    assert lines["stop"]["prompt_tokens"] == str(stopped.usage.prompt_tokens)
    assert lines["stop"]["trace_id"] == stopped.trace_id and lines["stop"]["mode"] == "sd"
    assert lines["stop"]["rounds"] == str(stopped.stats.rounds)
    assert lines["stream"]["mode"] == "off"
    assert all(PROMPT not in r.getMessage() and full.text not in r.getMessage() for r in caplog.records)


def _get(port: int, path: str) -> int:
    try:
        return urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5).status
    except urllib.error.HTTPError as error:
        return error.code


def test_the_metrics_port_serves_metrics_only(stack):
    port = stack.coordinator.metrics.port
    assert _get(port, "/metrics") == 200
    for path in ("/", "/health", "/v1/models", "/metrics/extra"):
        assert _get(port, path) == 404, path


def _http(stack, body: dict, request_id: str) -> tuple[int, dict]:
    call = urllib.request.Request(stack.http_url + "/v1/completions", json.dumps(body).encode(),
                                  {"Content-Type": "application/json", "X-Request-Id": request_id})
    try:
        with urllib.request.urlopen(call, timeout=CALL_TIMEOUT_S) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


def _http_client_goes_away(stack, body: dict, request_id: str) -> None:
    connection = http.client.HTTPConnection("127.0.0.1", stack.coordinator.http.port, timeout=CALL_TIMEOUT_S)
    try:
        connection.request("POST", "/v1/completions", json.dumps({**body, "stream": True}),
                           {"Content-Type": "application/json", "X-Request-Id": request_id})
        response = connection.getresponse()
        assert response.status == 200 and response.readline().startswith(b"data: ")
    finally:
        connection.close()


def test_http_requests_are_counted_and_logged_as_grpc_ones_are(tiny_pair, caplog):
    caplog.set_level(logging.INFO, logger="coordinator.request_log")
    with running_stack(*tiny_pair, coordinator_overrides={"metrics_port": 0, "http_port": 0}) as stack:
        body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True}
        status, finished = _http(stack, body, "h-length")
        assert status == 200
        status, _ = _http(stack, {**body, "temperature": -1}, "h-invalid")
        assert status == 400
        _http_client_goes_away(stack, {**body, "max_tokens": 400}, "h-gone")

        def count(name, **labels):
            return scrape(stack.coordinator.metrics.port).get((name, tuple(sorted(labels.items()))), 0)

        assert wait_for(lambda: count("specd_request_failure_total", code="CANCELLED") == 1, 10.0)
        metrics = scrape(stack.coordinator.metrics.port)
        failures = {dict(labels)["code"]: v for (name, labels), v in metrics.items() if name == "specd_request_failure_total"}
        assert failures == {"INVALID_ARGUMENT": 1, "CANCELLED": 1}
        assert count("specd_request_success_total", finished_reason="length") == 1
        assert metrics[("specd_prompt_tokens_total", ())] == finished["usage"]["prompt_tokens"]
        assert metrics[("specd_generation_tokens_total", ())] == finished["usage"]["completion_tokens"] == 12
    lines = _log_lines(caplog)
    assert {request_id: fields["status"] for request_id, fields in lines.items()} == {
        "h-length": "length", "h-invalid": "INVALID_ARGUMENT", "h-gone": "CANCELLED",
    }
    assert lines["h-length"]["trace_id"] == finished["specd"]["trace_id"]
