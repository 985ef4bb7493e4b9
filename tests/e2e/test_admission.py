"""Admission control end to end: places, the bounded queue, RESOURCE_EXHAUSTED past both, a
queued request that leaves, sessions and gauges back to zero, and the limit's flags.

The target's prefills are held (tests/stack.py, prefill_gate) so that admitted requests stay
running while the test fills the queue behind them: no test relies on how fast anything runs.
"""

from __future__ import annotations

import contextlib

import grpc
import pytest

from specd.cli import main
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, request, running_stack
from tests.stack import prefill_gate, wait_for

SETTLE_S = 20.0  # the most a gauge or a session count may take to reach what the test waits for
PROMPT_IDS = [5, 17, 33, 8, 41, 12]


def wait_until(condition, what: str, within_s: float = SETTLE_S) -> None:
    if not wait_for(condition, within_s):
        raise AssertionError(f"not within {within_s:.0f} s: {what}")


def gauge(stack, name: str) -> float:
    return stack.coordinator.servicer.metrics.registry.get_sample_value(name)


def sessions(stack) -> tuple[int, int]:
    return len(stack.target.servicer.runner.sessions), len(stack.draft.servicer.runner.sessions)


def _placed(stack, running: int, waiting: int) -> None:
    wait_until(
        lambda: (gauge(stack, "specd_requests_running"), gauge(stack, "specd_requests_waiting")) == (running, waiting),
        f"{running} running and {waiting} waiting",
    )


@contextlib.contextmanager
def held_prefills(tiny_pair, **overrides):
    """A stack whose target holds every prefill until the gate is released (at the latest on exit)."""
    with running_stack(*tiny_pair, **overrides) as stack:
        gate = prefill_gate(stack.target.servicer.runner)
        try:
            yield stack, stack.stub(), gate
        finally:
            gate.release()


def _message(max_new_tokens: int = 6) -> pb.GenerateRequest:
    return request(PROMPT_IDS, mode=pb.SPECULATION_MODE_SD, max_new_tokens=max_new_tokens)


def _stream_tokens(call) -> tuple[list[int], pb.GenerateStreamResponse]:
    tokens, last = [], None
    for last in call:
        tokens.extend(last.token_ids)
    return tokens, last


def test_a_burst_past_the_queue_is_refused_and_the_rest_complete(tiny_pair):
    limits = {"max_concurrent_requests": 2, "max_queued_requests": 2}
    with held_prefills(tiny_pair, coordinator_overrides=limits) as (stack, stub, gate):
        try:
            running = [stub.Generate.future(_message(), timeout=CALL_TIMEOUT_S) for _ in range(2)]
            _placed(stack, running=2, waiting=0)
            queued = [stub.GenerateStream(_message(), timeout=CALL_TIMEOUT_S) for _ in range(2)]
            _placed(stack, running=2, waiting=2)
            excess_unary = [stub.Generate.future(_message(), timeout=CALL_TIMEOUT_S) for _ in range(2)]
            excess_stream = stub.GenerateStream(_message(), timeout=CALL_TIMEOUT_S)
            for call in excess_unary:
                with pytest.raises(grpc.RpcError) as refused:
                    call.result()
                assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert refused.value.details() == "specd is serving its maximum of 2 requests with 2 queued; retry later"
            with pytest.raises(grpc.RpcError) as refused:
                _stream_tokens(excess_stream)
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert (gauge(stack, "specd_requests_running"), gauge(stack, "specd_requests_waiting")) == (2, 2)
        finally:
            gate.release()
        for call in running:
            response = call.result()
            assert response.finish_reason == pb.FINISH_REASON_LENGTH and len(response.token_ids) == 6
            assert response.stats.queue_ms == 0.0
        for call in queued:
            tokens, last = _stream_tokens(call)
            assert last.finish_reason == pb.FINISH_REASON_LENGTH and len(tokens) == 6
            assert last.stats.queue_ms > 0.0  # it waited behind the held requests
        # A place is held until its request's EndSession calls are answered, which can be after the
        # caller has its last token: wait for every place to be free, then one is served at once.
        _placed(stack, running=0, waiting=0)
        after = stub.Generate(_message(), timeout=CALL_TIMEOUT_S)  # served as usual afterwards
        assert after.finish_reason == pb.FINISH_REASON_LENGTH and after.stats.queue_ms == 0.0
        wait_until(lambda: sessions(stack) == (0, 0), "every worker session ended")
        _placed(stack, running=0, waiting=0)
        assert gauge(stack, "specd_request_queue_seconds_count") == 5  # the admitted: 2 + 2 queued + 1


def test_bad_input_is_refused_at_once_even_when_the_server_is_full(tiny_pair):
    """Checked before it queues: a full server tells a bad request what to change, not to retry,
    and a server with room in its queue does not make it wait there."""
    limits = {"max_concurrent_requests": 1, "max_queued_requests": 1}
    with held_prefills(tiny_pair, coordinator_overrides=limits) as (stack, stub, gate):
        try:
            running = stub.Generate.future(_message(), timeout=CALL_TIMEOUT_S)
            _placed(stack, running=1, waiting=0)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(request(PROMPT_IDS, max_new_tokens=0), timeout=CALL_TIMEOUT_S)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "max_new_tokens" in refused.value.details()
            queued = stub.Generate.future(_message(), timeout=CALL_TIMEOUT_S)
            _placed(stack, running=1, waiting=1)
            with pytest.raises(grpc.RpcError) as refused:
                stub.Generate(request(PROMPT_IDS, k=0), timeout=CALL_TIMEOUT_S)
            assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "num_speculative_tokens" in refused.value.details()
        finally:
            gate.release()
        assert running.result().finish_reason == queued.result().finish_reason == pb.FINISH_REASON_LENGTH


def test_a_queued_request_that_is_cancelled_or_times_out_leaves_the_queue(tiny_pair):
    limits = {"max_concurrent_requests": 1, "max_queued_requests": 4}
    with held_prefills(tiny_pair, coordinator_overrides=limits) as (stack, stub, gate):
        try:
            first = stub.Generate.future(_message(), timeout=CALL_TIMEOUT_S)
            _placed(stack, running=1, waiting=0)
            cancelled = stub.GenerateStream(_message(), timeout=CALL_TIMEOUT_S)
            _placed(stack, running=1, waiting=1)
            cancelled.cancel()
            _placed(stack, running=1, waiting=0)
            late = stub.Generate.future(_message(), timeout=1.0)  # its deadline passes in the queue
            with pytest.raises(grpc.RpcError) as timed_out:
                late.result()
            assert timed_out.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
            _placed(stack, running=1, waiting=0)
        finally:
            gate.release()
        assert first.result().finish_reason == pb.FINISH_REASON_LENGTH
        _placed(stack, running=0, waiting=0)
        wait_until(lambda: sessions(stack) == (0, 0), "every worker session ended")
        # The places the two left behind were not lost: two requests run one after the other.
        assert [stub.Generate(_message(), timeout=CALL_TIMEOUT_S).finish_reason for _ in range(2)] == [
            pb.FINISH_REASON_LENGTH
        ] * 2


def test_the_default_limit_follows_the_smaller_worker_cap(tiny_pair):
    """--max-concurrent-requests 0: the draft's 3 sessions less headroom allow 2 requests at once."""
    overrides = {"coordinator_overrides": {"max_queued_requests": 8}, "draft_overrides": {"max_sessions": 3}}
    with held_prefills(tiny_pair, **overrides) as (stack, stub, gate):
        try:
            calls = [stub.Generate.future(_message(), timeout=CALL_TIMEOUT_S) for _ in range(4)]
            _placed(stack, running=2, waiting=2)
        finally:
            gate.release()
        # No request lost speculation to the draft's cap: each ran sd.
        assert [call.result().stats.mode for call in calls] == [pb.SPECULATION_MODE_SD] * 4
        wait_until(lambda: sessions(stack) == (0, 0), "every worker session ended")


@pytest.mark.parametrize("flag", ["--max-concurrent-requests", "--max-queued-requests"])
def test_a_negative_limit_is_one_line_naming_its_flag(flag, capsys, monkeypatch):
    for name in ("SPECD_MAX_CONCURRENT_REQUESTS", "SPECD_MAX_QUEUED_REQUESTS"):
        monkeypatch.delenv(name, raising=False)
    assert main(["serve", "coordinator", flag, "-1", "--metrics-port", "-1"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(f"specd serve coordinator: {flag} must be >= 0")
