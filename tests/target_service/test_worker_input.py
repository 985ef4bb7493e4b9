"""The workers check what they are sent (issue 20): sampling no sampler can take, non-finite
draft probabilities, ids outside the vocabulary, over-sized Speculate and Propose calls and
over-long ids are INVALID_ARGUMENT; a VerifyAfter never waits without bound; an undecodable
message is INVALID_ARGUMENT on all three services; a StopIteration on a model thread fails the
call instead of hanging it. Afterwards the stack still decodes as before.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest

from draft_service.config import DraftConfig
from specd.core.sampling import SparseDist, sample_sparse
from specd.serving.model_thread import ModelThread
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from tests.conftest import CALL_TIMEOUT_S, request, running_stack

PROMPT = [5, 17, 42, 99, 7, 3]
VOCAB = 384  # tests/tiny_models.build_tokenizer
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0)
SAMPLED = common_pb2.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=7)
VERIFY_AFTER_WAIT_S = 1.0
QUICK_S = 10.0  # a refusal or a bounded wait answers well within this
HUGE_ID = "s" * (1 << 20)
BAD_SAMPLING = {
    "temperature NaN": dict(temperature=float("nan")),
    "temperature inf": dict(temperature=float("inf")),
    "temperature 1e-38": dict(temperature=1e-38),
    "temperature < 0": dict(temperature=-1.0),
    "top_p NaN": dict(temperature=1.0, top_p=float("nan")),
    "top_k < 0": dict(temperature=1.0, top_k=-3),
    "repetition_penalty 0": dict(repetition_penalty=0.0),
    "repetition_penalty NaN": dict(temperature=1.0, repetition_penalty=float("nan")),
}


@pytest.fixture(scope="module")
def stack(tiny_pair):
    with running_stack(*tiny_pair, target_overrides=dict(verify_after_wait_s=VERIFY_AFTER_WAIT_S)) as running:
        yield running


@pytest.fixture(scope="module")
def target(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.target.port}") as channel:
        yield target_pb2_grpc.TargetWorkerStub(channel)


@pytest.fixture(scope="module")
def draft(stack):
    with grpc.insecure_channel(f"127.0.0.1:{stack.draft.port}") as channel:
        yield draft_pb2_grpc.DraftWorkerStub(channel)


@pytest.fixture(scope="module")
def greedy_before(stack):
    """A greedy ssd request's output before any test here sent the workers anything."""
    return list(stack.stub().Generate(_generate_request(), timeout=CALL_TIMEOUT_S).token_ids)


def _generate_request():
    from specd.v1 import coordinator_pb2 as pb

    return request(PROMPT, mode=pb.SPECULATION_MODE_SSD, max_new_tokens=24)


def _committed(start: int = 0, tokens=PROMPT) -> common_pb2.CommittedTokens:
    return common_pb2.CommittedTokens(start=start, token_ids=tokens)


def _refused(call, message, code=grpc.StatusCode.INVALID_ARGUMENT, streaming=False) -> str:
    """Call, expect `code` within QUICK_S; the details, which never carry a traceback."""
    with pytest.raises(grpc.RpcError) as raised:
        result = call(message, timeout=QUICK_S)
        if streaming:
            list(result)
    error = raised.value
    assert error.code() == code, (error.code(), error.details())
    assert "Traceback" not in error.details() and len(error.details()) < 1000
    return error.details()


def _verify(session: str, drafts, probs, sampling=SAMPLED) -> target_pb2.VerifyRequest:
    return target_pb2.VerifyRequest(
        session_id=session, committed=_committed(), draft_tokens=drafts, draft_probs=probs, sampling=sampling
    )


def _speculate(session: str, drafts, fanout, num_tokens: int, sampling=GREEDY) -> draft_pb2.SpeculateRequest:
    return draft_pb2.SpeculateRequest(
        session_id=session, committed=_committed(), draft_tokens=drafts, fanout=fanout, num_tokens=num_tokens, sampling=sampling
    )


@pytest.mark.parametrize("name", list(BAD_SAMPLING))
def test_sampling_no_sampler_can_take_is_refused_by_both_workers(greedy_before, target, draft, name):
    sampling = common_pb2.SamplingParams(seed=1, **BAD_SAMPLING[name])
    field = name.split()[0]
    assert field in _refused(target.Verify, _verify("bad-sampling", [8], [], sampling))
    propose = draft_pb2.ProposeRequest(session_id="bad-sampling", committed=_committed(), num_tokens=2, sampling=sampling)
    assert field in _refused(draft.Propose, propose)
    assert field in _refused(draft.Speculate, _speculate("bad-sampling", [8], [1, 1], 2, sampling), streaming=True)


@pytest.mark.parametrize(
    "probs",
    [[float("nan"), 0.5], [float("inf"), 0.5], [-0.25, 1.25], [0.0, 0.0], [1.0]],
    ids=["NaN", "inf", "negative", "no mass", "lengths differ"],
)
def test_draft_probabilities_must_be_finite_and_non_negative(greedy_before, target, probs):
    dist = common_pb2.SparseDistribution(token_ids=[8, 9], probs=probs)
    assert "draft_probs[0]" in _refused(target.Verify, _verify("bad-q", [8], [dist]))


def test_ids_outside_the_vocabulary_are_refused(greedy_before, target, draft):
    dist = common_pb2.SparseDistribution(token_ids=[VOCAB], probs=[1.0])
    assert "draft_probs[0]" in _refused(target.Verify, _verify("bad-ids", [8], [dist]))
    assert "draft_tokens" in _refused(target.Verify, _verify("bad-ids", [VOCAB], [], GREEDY))
    assert "committed" in _refused(draft.Prefill, draft_pb2.DraftPrefillRequest(session_id="x", committed=_committed(0, [-1])))
    assert "draft_tokens" in _refused(draft.Speculate, _speculate("bad-ids", [2**31 - 1], [1, 1], 2), streaming=True)


def test_speculate_and_propose_sizes_are_bounded(greedy_before, draft):
    """The issue's 512 branches x 64 tokens (which held the draft's model thread 14 s) and any
    call past the configured bounds are refused before the model runs."""
    limits = DraftConfig()
    details = _refused(draft.Speculate, _speculate("big", [8], [256, 256], 64), streaming=True)
    assert "--max-speculate-branches" in details
    over_branches = _speculate("big", [8], [limits.max_speculate_branches, 1], 2)
    assert "fanout" in _refused(draft.Speculate, over_branches, streaming=True)
    over_depth = _speculate("big", [8], [1, 1], limits.max_speculate_depth + 1)
    assert "--max-speculate-depth" in _refused(draft.Speculate, over_depth, streaming=True)
    long_draft = [8] * (limits.max_speculate_depth + 1)
    assert "draft_tokens" in _refused(draft.Speculate, _speculate("big", long_draft, [1] * (len(long_draft) + 1), 1), streaming=True)
    propose = draft_pb2.ProposeRequest(session_id="big", committed=_committed(), num_tokens=limits.max_speculate_depth + 1, sampling=GREEDY)
    assert "num_tokens" in _refused(draft.Propose, propose)
    # At the bounds themselves the call runs.
    at_limits = _speculate("at-limits", [8], [limits.max_speculate_branches // 2] * 2, 2)
    answers = list(draft.Speculate(at_limits, timeout=CALL_TIMEOUT_S))
    assert len(answers[-1].cache.entries) == limits.max_speculate_branches
    draft.EndSession(draft_pb2.DraftEndSessionRequest(session_id="at-limits"), timeout=CALL_TIMEOUT_S)


def test_a_verify_of_too_many_draft_tokens_is_refused(greedy_before, target):
    """Bounded before the model runs: thousands of tokens fit the context but not a round."""
    from target_service.servicer import MAX_VERIFY_DRAFT_TOKENS

    details = _refused(target.Verify, _verify("long-verify", [8] * (MAX_VERIFY_DRAFT_TOKENS + 1), [], GREEDY))
    assert "draft_tokens" in details and str(MAX_VERIFY_DRAFT_TOKENS) in details


def test_long_session_ids_are_refused_and_not_echoed(greedy_before, target, draft):
    assert "session_id" in _refused(target.Prefill, target_pb2.TargetPrefillRequest(session_id=HUGE_ID, committed=_committed()))
    assert "session_id" in _refused(target.Verify, _verify(HUGE_ID, [8], [], GREEDY))
    assert "session_id" in _refused(target.VerifyAfter, target_pb2.VerifyAfterRequest(session_id=HUGE_ID, after=6))
    assert "session_id" in _refused(target.EndSession, target_pb2.TargetEndSessionRequest(session_id=HUGE_ID))
    assert "session_id" in _refused(draft.Prefill, draft_pb2.DraftPrefillRequest(session_id=HUGE_ID, committed=_committed()))
    assert "session_id" in _refused(draft.EndSession, draft_pb2.DraftEndSessionRequest(session_id=HUGE_ID))


def test_verify_after_an_unknown_session_is_not_found_at_once(greedy_before, target):
    details = _refused(target.VerifyAfter, target_pb2.VerifyAfterRequest(session_id="never-seen", after=6), grpc.StatusCode.NOT_FOUND)
    assert "never-seen" in details


def test_verify_after_a_verify_that_never_comes_answers_unmatched(greedy_before, target):
    """A known session, but a position no verify will reach: the wait ends at its bound."""
    target.Prefill(target_pb2.TargetPrefillRequest(session_id="far", committed=_committed()), timeout=CALL_TIMEOUT_S)
    answer = target.VerifyAfter(target_pb2.VerifyAfterRequest(session_id="far", after=400), timeout=VERIFY_AFTER_WAIT_S + QUICK_S)
    assert not answer.matched
    target.EndSession(target_pb2.TargetEndSessionRequest(session_id="far"), timeout=CALL_TIMEOUT_S)


METHODS = [
    ("coordinator", "/specd.v1.Coordinator/Generate", False),
    ("coordinator", "/specd.v1.Coordinator/GenerateStream", True),
    ("target", "/specd.v1.TargetWorker/Verify", False),
    ("target", "/specd.v1.TargetWorker/VerifyAfter", False),
    ("draft", "/specd.v1.DraftWorker/Speculate", True),
    ("draft", "/specd.v1.DraftWorker/Propose", False),
    ("draft", "/grpc.health.v1.Health/Check", False),
]


@pytest.mark.parametrize("role,method,streaming", METHODS, ids=[m for _, m, _ in METHODS])
def test_undecodable_messages_are_invalid_argument(greedy_before, stack, role, method, streaming):
    port = getattr(stack, role).port
    with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
        make = channel.unary_stream if streaming else channel.unary_unary
        call = make(method, request_serializer=None, response_deserializer=None)
        # A bad varint, a field longer than the message, invalid UTF-8 in field 1 (a string in each).
        for garbage in (b"\xff\xff\xff\xff\xff\xff", b"\x0a\x10ab", b"\x0a\x02\xc3\x28"):
            assert "does not decode" in _refused(call, garbage, streaming=streaming)


def test_a_stop_iteration_on_the_model_thread_fails_the_call():
    """asyncio cannot set StopIteration on a future: unconverted, the await would never end."""

    def exhausted():
        return next(iter([]))

    async def run():
        thread = ModelThread("stop-iteration")
        try:
            return await asyncio.wait_for(thread.run(exhausted), QUICK_S)
        finally:
            thread.shutdown()

    with pytest.raises(RuntimeError, match="StopIteration"):
        asyncio.run(run())


def test_sampling_a_distribution_without_mass_raises_value_error():
    with pytest.raises(ValueError):
        sample_sparse(SparseDist(token_ids=[3, 4], probs=[float("nan"), float("nan")]), 0.5)


def test_the_stack_decodes_as_before_after_all_this(stack, greedy_before):
    """Runs last in this file: no check above left a worker changed."""
    assert list(stack.stub().Generate(_generate_request(), timeout=CALL_TIMEOUT_S).token_ids) == greedy_before
