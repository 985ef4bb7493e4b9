"""A request's worker calls never open its session again once the request has ended.

A call still running when a request is cancelled may reach the worker after the request's
EndSession: it is answered NOT_FOUND, and a resend of the whole history from position 0 would
open the session again, held on the worker until its idle timeout. So the coordinator sends
nothing for an ended request (the first tests), and its EndSession retires the id (retire_id): a
worker refuses the calls for it that still arrive, for --retired-session-memory-s (the last
tests: a call sent after the EndSession is what such a late call looks like to the worker). An
EndSession that does not retire its id leaves it free to open again at once.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from coordinator.workers import WorkerSession, synced_call
from specd.core.errors import SessionNotFound
from specd.serving.retired_sessions import RetiredSessions
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, request, running_stack
from tests.stack import wait_for

PROMPT = [5, 17, 42, 99, 7, 3]
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0)
MEMORY_S = 1.0  # the workers' --retired-session-memory-s here


class _Worker:
    """Answers like a worker that lost (or ended) the session: NOT_FOUND unless sent from 0."""

    def __init__(self, on_first_call=None):
        self.sent: list[int] = []
        self.on_first_call = on_first_call

    async def __call__(self, tail: common_pb2.CommittedTokens, timeout_s: float):
        self.sent.append(tail.start)
        if len(self.sent) == 1 and self.on_first_call is not None:
            self.on_first_call()
        if tail.start != 0:
            raise grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, None, None, details="no such session")
        return common_pb2.CommittedTokens(start=0)


def _run(coro):
    return asyncio.run(coro)


def test_a_live_session_is_resent_from_the_start():
    session, worker = WorkerSession("s", sent=3), _Worker()
    _run(synced_call(session, [1, 2, 3, 4], worker, deadline=_far()))
    assert worker.sent == [3, 0]


def test_a_session_whose_request_ended_is_not_resent():
    session = WorkerSession("s", sent=3)
    worker = _Worker(on_first_call=lambda: setattr(session, "ended", True))  # the request ends meanwhile
    with pytest.raises(asyncio.CancelledError):
        _run(synced_call(session, [1, 2, 3, 4], worker, deadline=_far()))
    assert worker.sent == [3]


def test_nothing_is_sent_for_an_ended_session():
    session, worker = WorkerSession("s", ended=True), _Worker()
    with pytest.raises(asyncio.CancelledError):
        _run(synced_call(session, [1, 2], worker, deadline=_far()))
    assert worker.sent == []


def _far() -> float:
    return time.monotonic() + 60.0


class _Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_retired_id_is_refused_while_remembered_and_then_forgotten():
    clock = _Clock()
    ended = RetiredSessions(30.0, clock)
    ended.check("s")  # never ended: no refusal
    ended.add("s")
    clock.now += 29.0
    with pytest.raises(SessionNotFound, match="'s' was ended for good .* 29.0 s ago"):
        ended.check("s")
    ended.check("t")
    clock.now += 1.5
    ended.check("s")
    assert len(ended) == 0  # forgotten, not only let through


def test_retiring_an_id_again_remembers_it_from_the_new_end():
    clock = _Clock()
    ended = RetiredSessions(30.0, clock)
    ended.add("s")
    clock.now += 20.0
    ended.add("s")
    clock.now += 20.0  # 40 s after the first end, 20 s after the second
    with pytest.raises(SessionNotFound, match="20.0 s ago"):
        ended.check("s")


def test_a_memory_of_zero_remembers_nothing():
    ended = RetiredSessions(0.0, _Clock())
    ended.add("s")
    ended.check("s")


@pytest.fixture(scope="module")
def stack(tiny_pair):
    memory = dict(retired_session_memory_s=MEMORY_S)
    with running_stack(*tiny_pair, target_overrides=memory, draft_overrides=memory) as running:
        yield running


@pytest.fixture(scope="module")
def stubs(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.port}") as target, grpc.insecure_channel(
        f"127.0.0.1:{stack.draft.port}"
    ) as draft:
        yield target_pb2_grpc.TargetWorkerStub(target), draft_pb2_grpc.DraftWorkerStub(draft)


def _committed() -> common_pb2.CommittedTokens:
    return common_pb2.CommittedTokens(start=0, token_ids=PROMPT)


def _target_calls(session_id: str) -> dict:
    """Every target call that opens a session, from position 0, as a cancelled request sends it."""
    return {
        "Prefill": lambda stub: stub.Prefill(
            target_pb2.TargetPrefillRequest(session_id=session_id, committed=_committed()), timeout=CALL_TIMEOUT_S
        ),
        "Verify": lambda stub: stub.Verify(
            target_pb2.VerifyRequest(session_id=session_id, committed=_committed(), sampling=GREEDY), timeout=CALL_TIMEOUT_S
        ),
    }


def _draft_calls(session_id: str) -> dict:
    return {
        "Prefill": lambda stub: stub.Prefill(
            draft_pb2.DraftPrefillRequest(session_id=session_id, committed=_committed()), timeout=CALL_TIMEOUT_S
        ),
        "Propose": lambda stub: stub.Propose(
            draft_pb2.ProposeRequest(session_id=session_id, committed=_committed(), num_tokens=2, sampling=GREEDY),
            timeout=CALL_TIMEOUT_S,
        ),
        "Speculate": lambda stub: list(
            stub.Speculate(
                draft_pb2.SpeculateRequest(session_id=session_id, committed=_committed(), fanout=[1], num_tokens=1, sampling=GREEDY),
                timeout=CALL_TIMEOUT_S,
            )
        ),
    }


def _end(stub, role: str, session_id: str, retire_id: bool) -> bool:
    end_request = target_pb2.TargetEndSessionRequest if role == "target" else draft_pb2.DraftEndSessionRequest
    return stub.EndSession(end_request(session_id=session_id, retire_id=retire_id), timeout=CALL_TIMEOUT_S).existed


def _role(stack, stubs, role: str):
    """The role's stub, the calls that open its sessions, and its session store."""
    stub = dict(zip(("target", "draft"), stubs))[role]
    calls = _target_calls if role == "target" else _draft_calls
    return stub, calls, getattr(stack, role).servicer.runner.sessions


@pytest.mark.parametrize("role", ["target", "draft"])
def test_calls_after_a_retiring_end_session_are_refused_and_open_nothing(stack, stubs, role):
    stub, calls, sessions = _role(stack, stubs, role)
    for name, call in calls("late").items():
        call(stub)  # a live session: served
        assert "late" in sessions, name
        assert _end(stub, role, "late", retire_id=True)
        with pytest.raises(grpc.RpcError) as refused:
            call(stub)  # what a call sent before the EndSession and delivered after it meets
        assert refused.value.code() == grpc.StatusCode.NOT_FOUND, (name, refused.value.details())
        assert "ended for good" in refused.value.details()
        assert "late" not in sessions, name
        assert wait_for(lambda: _served(call, stub), timeout_s=MEMORY_S + 10.0), f"{name} not served once the memory passed"
        assert _end(stub, role, "late", retire_id=False)  # the next call opens it at once


def _served(call, stub) -> bool:
    try:
        call(stub)
    except grpc.RpcError as exc:
        assert exc.code() == grpc.StatusCode.NOT_FOUND, exc.details()
        return False
    return True


@pytest.mark.parametrize("role", ["target", "draft"])
def test_an_end_session_that_keeps_the_id_lets_it_open_again_at_once(stack, stubs, role):
    stub, calls, sessions = _role(stack, stubs, role)
    for name, call in calls("again").items():
        call(stub)
        assert _end(stub, role, "again", retire_id=False)
        call(stub)
        assert "again" in sessions, name
        assert _end(stub, role, "again", retire_id=False)


def test_a_session_the_worker_dropped_itself_opens_again_at_once(stack, stubs):
    """Idle expiry (or a restart) is not an end: the coordinator resends the session from 0 under
    the same id, and that must open it."""
    target, _ = stubs
    prefill = _target_calls("dropped")["Prefill"]
    prefill(target)
    runner = stack.target.servicer.runner
    assert runner.sessions.end("dropped")  # what idle expiry does: no EndSession
    prefill(target)
    assert "dropped" in runner.sessions
    assert _end(target, "target", "dropped", retire_id=False)


def test_the_coordinator_retires_each_request_s_ids_on_both_workers(stack):
    before = {role: len(getattr(stack, role).servicer.retired) for role in ("target", "draft")}
    stack.stub().Generate(request(PROMPT, mode=pb.SPECULATION_MODE_SD, max_new_tokens=4), timeout=CALL_TIMEOUT_S)
    # A place is held until the EndSession calls are answered; the caller may have its answer first.
    assert wait_for(lambda: all(len(getattr(stack, role).servicer.retired) == before[role] + 1 for role in before), 10.0)
