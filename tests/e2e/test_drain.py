"""A stopping coordinator drains: health NOT_SERVING and new requests refused with UNAVAILABLE
"... is stopping" at once, while a request already running finishes in full.

The target's prefill is held (tests/stack.py, prefill_gate) so that the request is still running
when the drain starts and while the test sends its new calls: nothing depends on how fast
anything runs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import urllib.error
import urllib.request

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from specd.serving.server import drain
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, request, running_stack
from tests.stack import prefill_gate, wait_for

MAX_NEW = 40


def _health(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        check = health_pb2_grpc.HealthStub(channel).Check
        return check(health_pb2.HealthCheckRequest(service=""), timeout=CALL_TIMEOUT_S).status


def test_a_draining_coordinator_refuses_new_requests_and_finishes_the_running_one(tiny_pair):
    with running_stack(*tiny_pair) as stack:
        coordinator = stack.coordinator
        gate = prefill_gate(stack.target.servicer.runner)
        try:
            stub = stack.stub()
            running = stub.GenerateStream(request([5, 17, 33], max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
            assert gate.held.wait(CALL_TIMEOUT_S) and coordinator.health.gate.running == 1
            drained = asyncio.run_coroutine_threadsafe(
                drain(coordinator.server, CALL_TIMEOUT_S, coordinator.health), stack.loop
            )
            assert wait_for(lambda: coordinator.health.gate.closed, CALL_TIMEOUT_S)
            assert _health(stack.address) == health_pb2.HealthCheckResponse.NOT_SERVING
            for call in (stub.Generate, lambda r, timeout: list(stub.GenerateStream(r, timeout=timeout))):
                try:
                    call(request([5, 17], max_new_tokens=4), timeout=CALL_TIMEOUT_S)
                    raise AssertionError("a draining coordinator accepted a new request")
                except grpc.RpcError as exc:
                    assert exc.code() == grpc.StatusCode.UNAVAILABLE, exc
                    assert "the Coordinator service is stopping" in exc.details(), exc.details()
            assert not drained.done()
        finally:
            gate.release()
        chunks = list(running)
        assert sum(len(chunk.token_ids) for chunk in chunks) == MAX_NEW
        assert chunks[-1].finish_reason == pb.FINISH_REASON_LENGTH
        drained.result(CALL_TIMEOUT_S)
        assert coordinator.health.gate.running == 0


def _post(url: str, body: dict) -> tuple[int, bytes]:
    call = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(call, timeout=CALL_TIMEOUT_S) as answer:
            return answer.status, answer.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()


def test_a_draining_coordinator_drains_its_http_api_too(tiny_pair):
    """The HTTP API's requests are running calls of the drain: a new one is a 503 that says the
    coordinator is stopping, /health is 503, and a stream already running finishes in full."""
    with running_stack(*tiny_pair, coordinator_overrides={"http_port": 0}) as stack:
        coordinator = stack.coordinator
        gate = prefill_gate(stack.target.servicer.runner)
        body = {"prompt": "def add(a, b): return a + b", "max_tokens": MAX_NEW, "temperature": 0, "ignore_eos": True, "stream": True,
                "speculation_mode": "sd", "stream_options": {"include_usage": True}}
        with concurrent.futures.ThreadPoolExecutor(1) as pool:
            try:
                running = pool.submit(_post, stack.http_url + "/v1/completions", body)
                assert gate.held.wait(CALL_TIMEOUT_S) and coordinator.health.gate.running == 1
                drained = asyncio.run_coroutine_threadsafe(
                    drain(coordinator.server, CALL_TIMEOUT_S, coordinator.health), stack.loop
                )
                assert wait_for(lambda: coordinator.health.gate.closed, CALL_TIMEOUT_S)
                status, refusal = _post(stack.http_url + "/v1/completions", {**body, "stream": False})
                assert status == 503 and "the Coordinator service is stopping" in json.loads(refusal)["error"]["message"]
                with pytest.raises(urllib.error.HTTPError) as health:
                    urllib.request.urlopen(stack.http_url + "/health", timeout=CALL_TIMEOUT_S)
                assert health.value.code == 503
                assert not drained.done()
            finally:
                gate.release()
            status, stream = running.result(CALL_TIMEOUT_S)
        events = [json.loads(e.removeprefix("data: ")) for e in stream.decode().split("\n\n") if e and e != "data: [DONE]"]
        assert status == 200 and events[-2]["choices"][0]["finish_reason"] == "length"
        assert events[-1]["usage"]["completion_tokens"] == MAX_NEW
        drained.result(CALL_TIMEOUT_S)
        assert coordinator.health.gate.running == 0
