"""Two coordinators on one worker pair: each sizes its admission from the workers' whole
--max-sessions (less headroom), so together they admit more requests than the target holds
sessions. A request the target refuses a session waits in its coordinator until one frees
(coordinator/session_wait.py): none fails for want of a worker session, and the only refusals
are each coordinator's admission's, with its message (past its places and its queue).

The target's prefills are held (tests/stack.py, prefill_gate) until every admitted request's
first call has reached it, so that more sessions are asked for at once than it holds.
"""

from __future__ import annotations

import grpc

from specd.v1 import coordinator_pb2 as pb
from specd.v1 import coordinator_pb2_grpc
from target_service.calls import PrefillCall
from tests.conftest import CALL_TIMEOUT_S, request, running_stack
from tests.stack import prefill_gate, wait_for

SESSIONS = 4  # the workers' --max-sessions
RUNNING = SESSIONS - 1  # what each coordinator runs at once: the cap less headroom (coordinator/admission.py)
QUEUED = 1  # --max-queued-requests
SENT = RUNNING + QUEUED + 1  # requests sent to each coordinator at once: more than half the workers' sessions
PROMPT_IDS = [5, 17, 33, 8, 41, 12]
SETTLE_S = 20.0


def wait_until(condition, what: str) -> None:
    if not wait_for(condition, SETTLE_S):
        raise AssertionError(f"not within {SETTLE_S:.0f} s: {what}")


def count_prefills_submitted(target) -> list[int]:
    """Prefill calls the target's servicer queues for its model thread from now on (the gate holds
    the first batch; the others wait in its batcher, where no session has been opened yet)."""
    batcher = target.servicer._batcher
    count, submit = [0], batcher.submit

    def counted(call):
        count[0] += isinstance(call, PrefillCall)
        return submit(call)

    batcher.submit = counted
    return count


def waiting(coordinator) -> float:
    return coordinator.servicer.metrics.registry.get_sample_value("specd_requests_waiting")


def outcome(call) -> str:
    try:
        response = call.result()
    except grpc.RpcError as exc:
        return f"{exc.code().name}: {exc.details()}"
    return f"finished {pb.FinishReason.Name(response.finish_reason)} with {len(response.token_ids)} tokens"


def test_two_coordinators_on_one_pair_stay_within_its_sessions(tiny_pair):
    overrides = {
        "target_overrides": {"max_sessions": SESSIONS},
        "draft_overrides": {"max_sessions": SESSIONS},
        "coordinator_overrides": {"max_queued_requests": QUEUED},
    }
    with running_stack(*tiny_pair, **overrides) as stack:
        second = stack.another_coordinator()
        coordinators = [stack.coordinator, second]
        stubs = [coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{c.port}")) for c in coordinators]
        prefills = count_prefills_submitted(stack.target)
        gate = prefill_gate(stack.target.servicer.runner)
        try:
            message = request(PROMPT_IDS, mode=pb.SPECULATION_MODE_SD, max_new_tokens=6)
            calls = [stub.Generate.future(message, timeout=CALL_TIMEOUT_S) for stub in stubs for _ in range(SENT)]
            wait_until(lambda: prefills[0] == 2 * RUNNING, "every running request's prefill at the target")
            wait_until(lambda: [waiting(c) for c in coordinators] == [QUEUED] * 2, "each coordinator's queue full")
            wait_until(lambda: sum(call.done() for call in calls) == 2, "one request refused by each coordinator")
        finally:
            gate.release()
        outcomes = [outcome(call) for call in calls]
        refusal = f"RESOURCE_EXHAUSTED: specd is serving its maximum of {RUNNING} requests with {QUEUED} queued; retry later"
        finished = "finished FINISH_REASON_LENGTH with 6 tokens"
        for sent in (outcomes[:SENT], outcomes[SENT:]):
            assert sorted(sent) == sorted([refusal] + [finished] * (RUNNING + QUEUED)), sent
        # The target was asked for more sessions than it holds, and the requests it refused waited.
        assert sum(c.servicer.target.session_wait.waits for c in coordinators) >= 2 * RUNNING - SESSIONS
        wait_until(lambda: len(stack.target.servicer.runner.sessions) == 0, "every target session ended")
        assert [c.servicer.target.session_wait.waiting for c in coordinators] == [0, 0]
