"""Workers that die or restart, unreachable targets, cancelled requests.

The coordinator owns the committed tokens: a lost draft only costs speed, a lost target is
UNAVAILABLE promptly, and a cancelled request frees its sessions on both workers.
"""

from __future__ import annotations

import socket
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.config import CoordinatorConfig
from coordinator.server import start_coordinator
from specd.v1 import coordinator_pb2 as pb
from specd.v1 import coordinator_pb2_grpc
from target_service.calls import PrefillCall, VerifyCall
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)
from tests.stack import RunnerGate, ServiceStack, count_calls, count_target_calls, verify_gate, wait_for

PROMPT = "def add(a, b):"
# "Promptly": the deadline of calls that must fail UNAVAILABLE (a hang ends DEADLINE_EXCEEDED).
UNAVAILABLE_WITHIN_S = 5.0
HANG_DEADLINE_S = 10.0
RESTARTED_USED_WITHIN_S = 2.5  # "within about a second" of a restart, with room for a loaded machine


@pytest.fixture(scope="module")
def reference(tiny_pair):
    model, tokenizer = load_reference(tiny_pair[0])
    ids = tokenizer.encode(PROMPT)
    return model, ids, greedy_reference(model, ids, 200)


@pytest.fixture
def stack(tiny_pair):
    with running_stack(*tiny_pair) as running:
        yield running


def _sessions(service) -> int:
    return len(service.servicer.runner.sessions)


def test_draft_down_falls_back_to_target_only_then_recovers(stack, reference):
    model, ids, greedy = reference
    stub = stack.stub()
    want = greedy[:32]
    off = stub.Generate(request(ids, mode=pb.SPECULATION_MODE_OFF, max_new_tokens=32), timeout=CALL_TIMEOUT_S)
    assert_greedy_equal_or_near_tie(model, ids, list(off.token_ids), want)

    stack.stop_draft()
    for mode in (pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_AUTO, pb.SPECULATION_MODE_SD):
        response = stub.Generate(request(ids, mode=mode, max_new_tokens=32), timeout=CALL_TIMEOUT_S)
        assert list(response.token_ids) == list(off.token_ids)
        assert response.stats.mode == pb.SPECULATION_MODE_OFF
        assert response.stats.fallback_reason, "a fallback must say why"
        assert response.stats.draft_tokens == 0
    info = stub.ModelInfo(pb.ModelInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert not info.draft_available and info.draft_model == ""

    stack.restart_draft()
    # The coordinator retries the draft after draft_retry_s = 0.2 s (and the channel's reconnect
    # back-off), so the first requests may still run some or all rounds target-only, saying why;
    # soon a request speculates in every round again.
    deadline = time.monotonic() + 5.0
    while True:
        response = stub.Generate(request(ids, mode=pb.SPECULATION_MODE_SD, max_new_tokens=32), timeout=CALL_TIMEOUT_S)
        assert list(response.token_ids) == list(off.token_ids)
        if response.stats.mode != pb.SPECULATION_MODE_SD:
            assert response.stats.fallback_reason
        clean = response.stats.mode == pb.SPECULATION_MODE_SD and not response.stats.fallback_reason
        if clean or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert response.stats.mode == pb.SPECULATION_MODE_SD, response.stats
    assert response.stats.draft_tokens > 0 and not response.stats.fallback_reason
    assert stub.ModelInfo(pb.ModelInfoRequest(), timeout=CALL_TIMEOUT_S).draft_available


def test_draft_restart_mid_request_keeps_the_result_exact(stack, reference):
    """The draft worker restarts (losing every session) while a request waits on the target."""
    model, ids, greedy = reference
    stub = stack.stub()
    call = stub.GenerateStream(request(ids, max_new_tokens=200, k=4), timeout=CALL_TIMEOUT_S)
    messages = [next(call)]
    gate = verify_gate(stack.target.servicer.runner)
    assert gate.held.wait(5.0)
    assert _sessions(stack.draft) == 1
    old_draft = stack.draft
    stack.stop_draft()
    stack.restart_draft()
    assert stack.draft is not old_draft and _sessions(stack.draft) == 0
    proposals = count_calls(stack.draft.servicer.runner, "propose_job")
    gate.release()
    messages.extend(call)
    final = messages[-1]
    assert final.finish_reason == pb.FINISH_REASON_LENGTH
    tokens = [t for m in messages for t in m.token_ids]
    assert_greedy_equal_or_near_tie(model, ids, tokens, greedy[:200])
    assert proposals[0] > 0, "the request never used the restarted draft"
    assert final.stats.mode == pb.SPECULATION_MODE_SD
    assert wait_for(lambda: _sessions(stack.draft) == 0 and _sessions(stack.target) == 0, 1.0)


def test_lost_target_session_mid_request_is_resent(stack, reference):
    """A target that lost a session (expiry, restart) mid-request gets the history resent: same tokens."""
    model, ids, greedy = reference
    stub = stack.stub()
    prefills = count_target_calls(stack.target.servicer.runner, PrefillCall)  # under the gate: it outlives it
    call = stub.GenerateStream(request(ids, max_new_tokens=200, k=4), timeout=CALL_TIMEOUT_S)
    messages = [next(call)]
    gate = verify_gate(stack.target.servicer.runner)
    assert gate.held.wait(5.0)
    store = stack.target.servicer.runner.sessions
    (session_id,) = list(store._sessions)
    assert store.end(session_id)  # as if it had expired while the Verify was on its way
    prefills_before = prefills[0]
    gate.release()
    messages.extend(call)
    tokens = [t for m in messages for t in m.token_ids]
    assert_greedy_equal_or_near_tie(model, ids, tokens, greedy[:200])
    assert prefills[0] == prefills_before  # the resend rides on Verify itself, from position 0


def test_target_restart_between_rounds_keeps_the_result_exact(stack, reference):
    """The target restarts (losing every session) while the draft proposes: no call is cut,
    so the request goes on, resending its history to the fresh target, with the same tokens."""
    model, ids, greedy = reference
    stub = stack.stub()
    call = stub.GenerateStream(request(ids, max_new_tokens=200, k=4), timeout=CALL_TIMEOUT_S)
    messages = [next(call)]
    gate = RunnerGate(stack.draft.servicer.runner, "propose_job")
    assert gate.held.wait(5.0)
    old_target = stack.target
    stack.stop_target()
    stack.restart_target()
    assert stack.target is not old_target and _sessions(stack.target) == 0
    verifies = count_target_calls(stack.target.servicer.runner, VerifyCall)
    gate.release()
    messages.extend(call)
    tokens = [t for m in messages for t in m.token_ids]
    assert messages[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert_greedy_equal_or_near_tie(model, ids, tokens, greedy[:200])
    assert verifies[0] > 0


def test_target_unreachable_at_start_is_unavailable_quickly(tiny_pair):
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]
    holder = ServiceStack(tiny_pair[0], None)  # only its event loop: nothing else is started
    config = CoordinatorConfig(
        host="127.0.0.1",
        port=0,
        metrics_port=-1,
        http_port=-1,
        target_address=f"127.0.0.1:{closed_port}",
        draft_address="",
        startup_timeout_s=60.0,
        worker_timeout_s=5.0,
    )
    try:
        holder.coordinator = holder.run(start_coordinator(config))
        channel = grpc.insecure_channel(holder.address)
        health = health_pb2_grpc.HealthStub(channel)
        stub = coordinator_pb2_grpc.CoordinatorStub(channel)
        time.sleep(0.5)  # let it try the target a few times
        status = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=HANG_DEADLINE_S).status
        assert status == health_pb2.HealthCheckResponse.NOT_SERVING
        for call in (
            lambda: stub.Generate(request([5, 6, 7], max_new_tokens=4), timeout=UNAVAILABLE_WITHIN_S),
            lambda: list(stub.GenerateStream(request([5, 6, 7], max_new_tokens=4), timeout=UNAVAILABLE_WITHIN_S)),
            lambda: stub.ModelInfo(pb.ModelInfoRequest(), timeout=UNAVAILABLE_WITHIN_S),
        ):
            with pytest.raises(grpc.RpcError) as raised:
                call()
            assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
        channel.close()
    finally:
        holder.close()


def test_target_killed_after_start_is_unavailable_quickly(tiny_pair):
    with running_stack(*tiny_pair) as stack:
        stub = stack.stub()
        assert len(stub.Generate(request([5, 6, 7], max_new_tokens=4), timeout=CALL_TIMEOUT_S).token_ids) == 4
        stack.run(stack.target.stop(0))
        for mode in (pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_OFF):
            for stream in (False, True):
                message = request([5, 6, 7], mode=mode, max_new_tokens=16)
                with pytest.raises(grpc.RpcError) as raised:
                    if stream:
                        list(stub.GenerateStream(message, timeout=UNAVAILABLE_WITHIN_S))
                    else:
                        stub.Generate(message, timeout=UNAVAILABLE_WITHIN_S)
                assert raised.value.code() == grpc.StatusCode.UNAVAILABLE, raised.value.details()
                assert "target" in raised.value.details()


@pytest.mark.parametrize("after_messages", [0, 1, 5])
@pytest.mark.parametrize("hold_verify", [False, True], ids=["running", "verify-held"])
def test_cancelled_stream_frees_sessions_on_both_workers(stack, reference, after_messages, hold_verify):
    _, ids, _ = reference
    stub = stack.stub()
    call = stub.GenerateStream(request(ids, max_new_tokens=400, k=4), timeout=CALL_TIMEOUT_S)
    if after_messages == 0:
        # As soon as both workers hold the session (during or right after the prefill).
        assert wait_for(lambda: _sessions(stack.target) == 1 and _sessions(stack.draft) == 1, 5.0)
    for _ in range(after_messages):
        next(call)
    gate = None
    if hold_verify:  # cancel while a Verify runs on the target: the session must still go
        gate = verify_gate(stack.target.servicer.runner)
        assert gate.held.wait(5.0)
    assert _sessions(stack.target) == 1 and _sessions(stack.draft) == 1
    call.cancel()
    if gate is not None:
        time.sleep(0.1)
        gate.release()
    assert wait_for(lambda: _sessions(stack.target) == 0 and _sessions(stack.draft) == 0, 1.0), (
        f"sessions left: target {_sessions(stack.target)}, draft {_sessions(stack.draft)}"
    )
    # And they stay freed: nothing in flight re-creates them.
    time.sleep(0.3)
    assert _sessions(stack.target) == 0 and _sessions(stack.draft) == 0
    # The stack still serves.
    assert len(stub.Generate(request(ids, max_new_tokens=8), timeout=CALL_TIMEOUT_S).token_ids) == 8


def test_cancelled_unary_requests_free_sessions(stack, reference):
    _, ids, _ = reference
    stub = stack.stub()
    futures = [stub.Generate.future(request(ids, max_new_tokens=400, k=k), timeout=CALL_TIMEOUT_S) for k in (1, 4)]
    assert wait_for(lambda: _sessions(stack.target) == 2, 5.0)
    gate = verify_gate(stack.target.servicer.runner)
    assert gate.held.wait(5.0)
    for future in futures:
        future.cancel()
    time.sleep(0.1)
    gate.release()
    assert wait_for(lambda: _sessions(stack.target) == 0 and _sessions(stack.draft) == 0, 1.0)


def test_client_deadline_frees_sessions(stack, reference):
    _, ids, _ = reference
    stub = stack.stub()
    gate = verify_gate(stack.target.servicer.runner)
    with pytest.raises(grpc.RpcError) as raised:
        stub.Generate(request(ids, max_new_tokens=400), timeout=0.5)
    assert raised.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert gate.held.is_set()
    gate.release()
    assert wait_for(lambda: _sessions(stack.target) == 0 and _sessions(stack.draft) == 0, 1.0)


@pytest.mark.parametrize("worker", ["draft", "target"])
def test_worker_back_after_an_outage_is_used_within_seconds(stack, reference, worker):
    """After a long outage a restarted worker is used again within about a second, whatever
    back-off the coordinator's channel built up while it was away (gRPC's default grows to 120 s)."""
    _, ids, greedy = reference
    stub = stack.stub()
    message = request(ids, mode=pb.SPECULATION_MODE_SD, max_new_tokens=8)
    getattr(stack, f"stop_{worker}")()
    outage_until = time.monotonic() + 5.5  # long enough for several growing reconnect back-offs
    while time.monotonic() < outage_until:
        try:  # answered (target-only) or refused, within the deadline, never hung
            response = stub.Generate(message, timeout=UNAVAILABLE_WITHIN_S)
            assert worker == "draft" and response.stats.mode == pb.SPECULATION_MODE_OFF
        except grpc.RpcError as error:
            assert worker == "target" and error.code() == grpc.StatusCode.UNAVAILABLE, error
        time.sleep(0.2)
    getattr(stack, f"restart_{worker}")()
    response = _sd_response_within(stub, message, worker, RESTARTED_USED_WITHIN_S)
    assert list(response.token_ids) == greedy[:8]


def _sd_response_within(stub, message: pb.GenerateRequest, worker: str, deadline_s: float) -> pb.GenerateResponse:
    """The first response that ran sd without a fallback, all of it within deadline_s (each call's
    deadline is the time left); until then the stopped `worker` may still refuse (target only)."""
    deadline = time.monotonic() + deadline_s
    while (left := deadline - time.monotonic()) > 0:
        try:
            response = stub.Generate(message, timeout=left)
            if response.stats.mode == pb.SPECULATION_MODE_SD and not response.stats.fallback_reason:
                return response
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                break
            assert worker == "target" and error.code() == grpc.StatusCode.UNAVAILABLE, error
        time.sleep(0.05)
    pytest.fail(f"the restarted {worker} is not used within {deadline_s} s")
