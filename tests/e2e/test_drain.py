"""A stopping coordinator drains: health NOT_SERVING and new requests refused with UNAVAILABLE
"... is stopping" at once, while a request already running finishes in full.

The target's prefill is held (tests/stack.py, prefill_gate) so that the request is still running
when the drain starts and while the test sends its new calls: nothing depends on how fast
anything runs.
"""

from __future__ import annotations

import asyncio

import grpc
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
