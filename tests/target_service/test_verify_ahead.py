"""Verifies sent ahead (VerifyAfter): the target runs the choice written for the outcome of the
session's previous verify, with the same result a plain Verify sent afterwards would get;
nothing runs for an outcome no choice names; ssd output stays exact when rounds go this way.
"""

from __future__ import annotations

import time

import grpc
import pytest

from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from specd.v1 import coordinator_pb2 as pb
from target_service.calls import VerifyCall
from target_service.verify_after import VerifyOutcomes
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)
from tests.stack import count_target_calls, slow_verify

PROMPT = [5, 17, 42, 99, 7, 3]
GREEDY = common_pb2.SamplingParams(temperature=0.0, top_k=0, top_p=1.0, seed=0)
SAMPLED = common_pb2.SamplingParams(temperature=1.0, top_k=0, top_p=1.0, seed=7)


# --- the outcome register -------------------------------------------------------------------


def _run_into(run_choice):
    """An `enqueue` for VerifyOutcomes that runs the chosen verify where it is called (the
    worker's batcher runs it on the model thread); a cancelled answer's choice does not run."""

    def enqueue(answer, choice):
        if answer.set_running_or_notify_cancel():
            try:
                answer.set_result(run_choice(choice))
            except Exception as exc:  # noqa: BLE001 - the caller's RPC reports it
                answer.set_exception(exc)

    return enqueue


def _register(capacity: int = 4096) -> tuple[VerifyOutcomes, list]:
    """A register whose chosen verifies are recorded in a list, run at once where queued."""
    ran = []

    def run_choice(choice):
        ran.append(choice)
        return f"verified {choice}"

    return VerifyOutcomes(_run_into(run_choice), capacity=capacity), ran


def test_the_choice_for_the_outcome_runs_whether_sent_before_or_after_it():
    outcomes, ran = _register()
    early = outcomes.expect("s", 10, {(2, 77): "a", (1, 5): "b"})
    assert not early.answer.done() and ran == []
    outcomes.record("s", 10, (2, 77))
    late = outcomes.expect("s", 10, {(2, 77): "c"})
    assert early.answer.result(0) == "verified a" and late.answer.result(0) == "verified c"
    assert ran == ["a", "c"]


def test_chosen_verifies_follow_one_another_on_the_model_thread_alone():
    """No event loop at all: each verify's outcome queues the next chosen one on its thread."""
    import concurrent.futures
    import threading

    model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    threads = []
    outcomes: VerifyOutcomes

    def run_choice(choice):  # a verify of `committed` tokens whose outcome is `outcome`
        committed, outcome = choice
        threads.append(threading.current_thread())
        outcomes.record("s", committed, outcome)
        return choice

    outcomes = VerifyOutcomes(lambda answer, choice: model_thread.submit(_run_into(run_choice), answer, choice))
    second = outcomes.expect("s", 10, {(1, 5): (12, (3, 9)), (0, 4): (11, (0, 0))})
    third = outcomes.expect("s", 12, {(3, 9): (16, (2, 2))})
    model_thread.submit(outcomes.record, "s", 10, (1, 5)).result(5)  # the first verify ends
    assert third.answer.result(5) == (16, (2, 2)) and second.answer.result(5) == (12, (3, 9))
    assert len(threads) == 2 and all(t is not threading.main_thread() for t in threads)
    model_thread.shutdown()


def test_nothing_runs_for_an_unnamed_passed_or_ended_verify():
    outcomes, ran = _register()
    outcomes.record("s", 10, (1, 5))
    outcomes.record("s", 13, (4, 6))  # a later verify of the same session
    passed = outcomes.expect("s", 10, {(1, 5): "x"})
    waiting = outcomes.expect("s", 20, {(0, 1): "x"})
    skipped = outcomes.expect("t", 8, {(0, 1): "x"})
    unnamed = outcomes.expect("u", 4, {(0, 1): "x"})
    outcomes.record("t", 9, (0, 1))  # 8 never came: t moved past it
    outcomes.record("u", 4, (3, 3))  # no choice for this outcome
    outcomes.forget("s")
    assert [w.answer.result(0) for w in (passed, waiting, skipped, unnamed)] == [None] * 4
    assert ran == []


def test_a_discarded_choice_does_not_run():
    outcomes, ran = _register()
    waiter = outcomes.expect("s", 10, {(2, 77): "a"})
    outcomes.discard("s", waiter)
    outcomes.record("s", 10, (2, 77))
    assert waiter.answer.cancelled() and ran == []


def test_a_choice_that_cannot_be_queued_fails_its_call():
    def refuse(answer, choice):
        raise RuntimeError("cannot schedule new futures after shutdown")

    outcomes = VerifyOutcomes(refuse)
    waiter = outcomes.expect("s", 10, {(2, 77): "a"})
    outcomes.record("s", 10, (2, 77))
    with pytest.raises(RuntimeError, match="shutdown"):
        waiter.answer.result(0)


def test_outcomes_keep_a_bounded_number_of_sessions():
    outcomes, ran = _register(capacity=2)
    for name in ("a", "b", "c"):
        outcomes.record(name, 4, (0, 1))
    recent = outcomes.expect("c", 4, {(0, 1): "x"})
    oldest = outcomes.expect("a", 4, {(0, 1): "x"})  # "a" was forgotten: it waits for a verify
    assert recent.answer.result(0) == "verified x" and not oldest.answer.done()


# --- the target worker's VerifyAfter ----------------------------------------------------------


@pytest.fixture(scope="module")
def target_stub(tiny_pair):
    with running_stack(tiny_pair[0], None) as stack:
        channel = grpc.insecure_channel(f"127.0.0.1:{stack.target.port}")
        yield stack, target_pb2_grpc.TargetWorkerStub(channel)
        channel.close()


def _verify_request(
    session: str, start: int, tokens: list[int], drafts: list[int], sampling: common_pb2.SamplingParams = GREEDY
) -> target_pb2.VerifyRequest:
    """Sampled: each draft token drawn from a q that gives it half the mass, its neighbours the rest."""
    draft_probs = []
    if sampling.temperature > 0:
        draft_probs = [
            common_pb2.SparseDistribution(token_ids=[d, (d + 1) % 300, (d + 2) % 300], probs=[0.5, 0.3, 0.2]) for d in drafts
        ]
    return target_pb2.VerifyRequest(
        session_id=session,
        committed=common_pb2.CommittedTokens(start=start, token_ids=tokens),
        draft_tokens=drafts,
        draft_probs=draft_probs,
        sampling=sampling,
        return_logprobs=True,
    )


def _prefill(stub, session: str) -> None:
    stub.Prefill(
        target_pb2.TargetPrefillRequest(session_id=session, committed=common_pb2.CommittedTokens(start=0, token_ids=PROMPT)),
        timeout=CALL_TIMEOUT_S,
    )


def _end(stub, session: str) -> None:
    stub.EndSession(target_pb2.TargetEndSessionRequest(session_id=session), timeout=CALL_TIMEOUT_S)


def _plain_rounds(stub, session: str, first_draft: list[int], second_draft: list[int], sampling):
    """Two rounds by plain Verify calls: the reference a verify sent ahead must equal."""
    _prefill(stub, session)
    first = stub.Verify(_verify_request(session, 0, PROMPT, first_draft, sampling), timeout=CALL_TIMEOUT_S)
    emitted = first_draft[: first.accepted] + [first.next_token]
    second = stub.Verify(_verify_request(session, len(PROMPT), emitted, second_draft, sampling), timeout=CALL_TIMEOUT_S)
    _end(stub, session)
    return first, emitted, second


@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_choice_for_the_outcome_runs_right_after(target_stub, sampling):
    """Randomness is keyed by seed and position: a sampled verify sent ahead draws what a
    plain one would, so equality here carries the sampled tests of Verify over to it."""
    stack, stub = target_stub
    first_draft, second_draft = [8, 9, 10, 11], [1, 2, 3]
    first, emitted, second = _plain_rounds(stub, "reference", first_draft, second_draft, sampling)

    _prefill(stub, "ahead")
    decoy = target_pb2.VerifyChoice(
        accepted=first.accepted,
        next_token=(first.next_token + 1) % 300,
        verify=_verify_request("ahead", len(PROMPT), first_draft[: first.accepted] + [(first.next_token + 1) % 300], [4], sampling),
    )
    right = target_pb2.VerifyChoice(
        accepted=first.accepted,
        next_token=first.next_token,
        verify=_verify_request("ahead", len(PROMPT), emitted, second_draft, sampling),
    )
    # Sent before the verify it follows: it waits for that verify's outcome.
    ahead = stub.VerifyAfter.future(
        target_pb2.VerifyAfterRequest(session_id="ahead", after=len(PROMPT), choices=[decoy, right]), timeout=CALL_TIMEOUT_S
    )
    time.sleep(0.2)
    assert not ahead.done()
    got_first = stub.Verify(_verify_request("ahead", 0, PROMPT, first_draft, sampling), timeout=CALL_TIMEOUT_S)
    answer = ahead.result(timeout=CALL_TIMEOUT_S)
    _end(stub, "ahead")

    assert (got_first.accepted, got_first.next_token) == (first.accepted, first.next_token)
    assert answer.matched
    got = answer.verify
    assert (got.accepted, got.next_token, got.next_token_kind, got.cached_tokens) == (
        second.accepted,
        second.next_token,
        second.next_token_kind,
        second.cached_tokens,
    )
    assert list(got.logprobs) == pytest.approx(list(second.logprobs), abs=1e-5)


def test_no_choice_for_the_outcome_runs_nothing(target_stub):
    stack, stub = target_stub
    verifies = count_target_calls(stack.target.servicer.runner, VerifyCall)
    _prefill(stub, "unmatched")
    first = stub.Verify(_verify_request("unmatched", 0, PROMPT, [8, 9]), timeout=CALL_TIMEOUT_S)
    wrong = (first.next_token + 1) % 300
    choice = target_pb2.VerifyChoice(
        accepted=first.accepted, next_token=wrong, verify=_verify_request("unmatched", len(PROMPT), [8, 9][: first.accepted] + [wrong], [4])
    )
    # Sent after the verify it follows has answered: it still knows that verify's outcome.
    answer = stub.VerifyAfter(
        target_pb2.VerifyAfterRequest(session_id="unmatched", after=len(PROMPT), choices=[choice]), timeout=CALL_TIMEOUT_S
    )
    assert not answer.matched
    assert verifies[0] == 1
    emitted = [8, 9][: first.accepted] + [first.next_token]
    stub.Verify(_verify_request("unmatched", len(PROMPT), emitted, [4]), timeout=CALL_TIMEOUT_S)  # the session goes on
    _end(stub, "unmatched")


def test_an_ended_session_releases_a_waiting_verify_after(target_stub):
    _, stub = target_stub
    _prefill(stub, "ending")
    ahead = stub.VerifyAfter.future(
        target_pb2.VerifyAfterRequest(session_id="ending", after=len(PROMPT)), timeout=CALL_TIMEOUT_S
    )
    time.sleep(0.2)
    _end(stub, "ending")
    assert not ahead.result(timeout=10).matched


def test_a_choice_for_another_position_is_refused(target_stub):
    _, stub = target_stub
    choice = target_pb2.VerifyChoice(accepted=0, next_token=1, verify=_verify_request("bad", 3, [1], [2]))
    with pytest.raises(grpc.RpcError) as err:
        stub.VerifyAfter(target_pb2.VerifyAfterRequest(session_id="bad", after=6, choices=[choice]), timeout=CALL_TIMEOUT_S)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "position 6" in err.value.details()


# --- ssd rounds through VerifyAfter ---------------------------------------------------------


def _record_verify_after(coordinator_servicer) -> list[bool]:
    """Whether each VerifyAfter the coordinator sent found its outcome among its choices."""
    matched: list[bool] = []
    link = coordinator_servicer.target
    original = link.verify_after

    async def recorded(*args, **kwargs):
        answer = await original(*args, **kwargs)
        matched.append(answer.matched)
        return answer

    link.verify_after = recorded
    return matched


@pytest.mark.parametrize("verify_ahead", [True, False])
def test_ssd_rounds_verified_ahead_stay_exact(tiny_pair, verify_ahead):
    model, tokenizer = load_reference(tiny_pair[0])
    prompt = "def add(a, b):"
    ids = tokenizer.encode(prompt, add_special_tokens=True)
    want = greedy_reference(model, ids, 40)
    overrides = dict(ssd_budget=16, ssd_backup="jit", ssd_verify_ahead=verify_ahead)
    with running_stack(*tiny_pair, coordinator_overrides=overrides) as stack:
        slow_verify(stack.target.servicer.runner, 0.05)
        matched = _record_verify_after(stack.coordinator.servicer)
        response = stack.stub().Generate(
            request(ids, mode=pb.SPECULATION_MODE_SSD, k=4, max_new_tokens=40), timeout=CALL_TIMEOUT_S
        )
    assert_greedy_equal_or_near_tie(model, ids, list(response.token_ids), want)
    assert response.stats.cache_hits > 0
    if verify_ahead:
        assert sum(matched) > 0  # rounds did start on the target with no round trip
        assert 0 < response.stats.verified_ahead <= sum(matched)
    else:
        assert matched == [] and response.stats.verified_ahead == 0


@pytest.mark.parametrize("max_new_tokens", [7, 24])
def test_requests_verified_ahead_end_cleanly(tiny_pair, max_new_tokens):
    """At the length limit and at a stop string, rounds sent ahead are dropped: the output is
    the reference's, cut where it should be, and neither worker keeps the session."""
    model, tokenizer = load_reference(tiny_pair[0])
    ids = tokenizer.encode("class Point:\n    def", add_special_tokens=True)
    want = greedy_reference(model, ids, max_new_tokens)
    stop = tokenizer.decode(want[len(want) // 2 : len(want) // 2 + 2])
    overrides = dict(ssd_budget=16, ssd_backup="jit")
    with running_stack(*tiny_pair, coordinator_overrides=overrides) as stack:
        slow_verify(stack.target.servicer.runner, 0.05)
        matched = _record_verify_after(stack.coordinator.servicer)
        stub = stack.stub()
        by_length = stub.Generate(request(ids, mode=pb.SPECULATION_MODE_SSD, max_new_tokens=max_new_tokens), timeout=CALL_TIMEOUT_S)
        by_stop = stub.Generate(
            request(ids, mode=pb.SPECULATION_MODE_SSD, max_new_tokens=max_new_tokens, stop=[stop]), timeout=CALL_TIMEOUT_S
        )
        _assert_sessions_end(stack)
    assert_greedy_equal_or_near_tie(model, ids, list(by_length.token_ids), want)
    assert by_stop.finish_reason == pb.FINISH_REASON_STOP
    assert stop in tokenizer.decode(list(by_stop.token_ids))
    assert list(by_stop.token_ids) == want[: len(by_stop.token_ids)]
    if max_new_tokens > 7:
        assert sum(matched) > 0


@pytest.mark.parametrize(
    "case, speculate_early, min_probability",
    [
        ("self-draft", True, None),  # acceptance 1: the likeliest outcome always comes
        ("tiny-pair", True, 0.0),  # early for any outcome: most are wrong and cancelled
        ("tiny-pair", False, None),
    ],
)
def test_speculate_started_early_stays_exact(tiny_pair, case, speculate_early, min_probability, monkeypatch):
    """Round T+1's Speculate starts for round T's likeliest outcome before Verify(T) answers;
    an outcome that does not come cancels it. Either way the output is the target's own, and
    both workers end the session."""
    from coordinator import ssd_speculator

    if min_probability is not None:
        monkeypatch.setattr(ssd_speculator, "_EARLY_MIN_PROBABILITY", min_probability)
    target, draft = tiny_pair
    if case == "self-draft":
        draft = target
    model, tokenizer = load_reference(target)
    ids = tokenizer.encode("def add(a, b):", add_special_tokens=True)
    want = greedy_reference(model, ids, 48)
    overrides = dict(ssd_budget=16, ssd_backup="jit", ssd_speculate_early=speculate_early)
    with running_stack(target, draft, coordinator_overrides=overrides) as stack:
        slow_verify(stack.target.servicer.runner, 0.05)
        response = stack.stub().Generate(
            request(ids, mode=pb.SPECULATION_MODE_SSD, k=4, max_new_tokens=48), timeout=CALL_TIMEOUT_S
        )
        _assert_sessions_end(stack)
    assert_greedy_equal_or_near_tie(model, ids, list(response.token_ids), want)
    stats = response.stats
    assert stats.cache_hits > 0 and stats.verified_ahead > 0
    if case == "self-draft":
        assert stats.speculated_early >= stats.rounds // 2  # most trees started before the previous verify answered
    if not speculate_early:
        assert stats.speculated_early == 0


def _assert_sessions_end(stack, timeout_s: float = 5.0) -> None:
    """Neither worker keeps a session once the requests are over (EndSession goes out after
    the answer, so give it a moment)."""
    runners = (stack.target.servicer.runner, stack.draft.servicer.runner)
    deadline = time.monotonic() + timeout_s
    while any(len(r.sessions) for r in runners) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [len(r.sessions) for r in runners] == [0, 0]
