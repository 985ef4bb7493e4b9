"""A target worker with --kv-cache-bytes: the session a call opens reserves the room its
CommittedTokens.reserve_tokens asks; one that does not fit beside the others is refused
RESOURCE_EXHAUSTED, and a coordinator's requests, which reserve their most tokens, run within it
(one that finds no room waits for it, as for a session: coordinator/session_wait.py).
A budget smaller than the model's context makes the context the worker serves."""

from __future__ import annotations

import time

import grpc
import pytest

from specd.engine.kv_budget import kv_bytes_per_token
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, load_reference, request, running_stack

PROMPT = [5, 17, 42, 99, 7, 3]
BUDGET_TOKENS = 300


@pytest.fixture(scope="module")
def per_token(tiny_pair):
    model, _tokenizer = load_reference(tiny_pair[0])
    return kv_bytes_per_token(model)


@pytest.fixture(scope="module")
def stack(tiny_pair, per_token):
    with running_stack(*tiny_pair, target_overrides=dict(kv_cache_bytes=BUDGET_TOKENS * per_token)) as running:
        yield running


@pytest.fixture(scope="module")
def target(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.port}") as channel:
        yield target_pb2_grpc.TargetWorkerStub(channel)


def test_a_budget_below_the_context_is_the_context_served(target):
    info = target.Info(target_pb2.TargetInfoRequest(), timeout=CALL_TIMEOUT_S)
    assert info.context_length == BUDGET_TOKENS
    with pytest.raises(grpc.RpcError) as refused:
        _prefill(target, "too-long", 0, tokens=[5] * (BUDGET_TOKENS + 1))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def _prefill(target, session_id: str, reserve_tokens: int, tokens: list[int] = PROMPT):
    committed = common_pb2.CommittedTokens(start=0, token_ids=tokens, reserve_tokens=reserve_tokens)
    return target.Prefill(target_pb2.TargetPrefillRequest(session_id=session_id, committed=committed), timeout=CALL_TIMEOUT_S)


def test_a_session_that_does_not_fit_the_budget_is_refused_until_room_frees(target):
    _prefill(target, "first", 200)
    with pytest.raises(grpc.RpcError) as clamped:
        _prefill(target, "beyond", 1 << 20)  # a reservation is clamped to the context served: the whole budget
    assert f"a session of {BUDGET_TOKENS} tokens" in clamped.value.details()
    with pytest.raises(grpc.RpcError) as refused:
        _prefill(target, "second", 200)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "KV cache budget" in refused.value.details() and "200 tokens" in refused.value.details()
    _end(target, "first")
    _prefill(target, "second", 200)
    _end(target, "second")


def test_a_call_refused_a_session_is_told_at_once_without_a_place_in_a_forward(stack, target):
    """A Prefill or a round-0 Verify the budget has no room for is refused before its batch: the
    target's batches see only the calls it serves (a refused call's retries cost no forward)."""
    batcher = stack.target.servicer._batcher
    batched = []
    batcher.submit = lambda call, submit=batcher.submit: batched.append(call.session_id) or submit(call)
    try:
        _prefill(target, "whole-budget", BUDGET_TOKENS)
        committed = common_pb2.CommittedTokens(start=0, token_ids=PROMPT, reserve_tokens=10)
        refused_calls = (
            lambda: _prefill(target, "no-room", 10),
            lambda: target.Verify(target_pb2.VerifyRequest(session_id="no-room", committed=committed), timeout=CALL_TIMEOUT_S),
        )
        for call in refused_calls:
            with pytest.raises(grpc.RpcError) as refused:
                call()
            assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "KV cache budget" in refused.value.details()
        assert batched == ["whole-budget"]
    finally:
        del batcher.submit
        _end(target, "whole-budget")


def test_coordinator_requests_reserve_their_most_tokens_and_wait_for_room(stack, target):
    """Beside a session holding 200 of the 300 tokens, a request of 6 + 48 tokens runs (it reserves
    its 54 and two verifies' drafts); one of 6 + 120 waits for room, and runs once that session ends."""
    _prefill(target, "holder", 200)
    held = True
    try:
        fits = stack.stub().Generate(request(PROMPT, mode=pb.SPECULATION_MODE_SD, max_new_tokens=48), timeout=CALL_TIMEOUT_S)
        assert len(fits.token_ids) == 48
        waits = stack.stub().Generate.future(request(PROMPT, mode=pb.SPECULATION_MODE_SD, max_new_tokens=120), timeout=CALL_TIMEOUT_S)
        session_wait = stack.coordinator.servicer.target.session_wait
        _until(lambda: session_wait.waiting == 1, "the request waits for KV room")
        assert not waits.done()
        metrics = stack.coordinator.servicer.metrics.registry
        assert metrics.get_sample_value("specd_requests_waiting_for_session") == 1
        _end(target, "holder")
        held = False
        assert len(waits.result().token_ids) == 120
    finally:
        if held:
            _end(target, "holder")


def _end(target, session_id: str) -> None:
    target.EndSession(target_pb2.TargetEndSessionRequest(session_id=session_id), timeout=CALL_TIMEOUT_S)


def _until(condition, what: str, within_s: float = 30.0) -> None:
    deadline = time.monotonic() + within_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {within_s:.0f} s: {what}")
        time.sleep(0.01)
