"""A long catch-up (a new prompt) in a forward shared with other sessions runs a chunk at a time.

Without chunks, one 300-token prompt packed with seven one-token steps makes that forward as
slow as the prompt's prefill for all eight sessions. With `prefill_chunk` N, the call caches N
committed tokens per shared forward and runs again (AGAIN) until the rest fits; alone it
catches up in one forward. Outcomes must not change.
"""

from __future__ import annotations

import concurrent.futures
import pickle
import threading

import pytest

from specd.core.errors import SessionNotFound
from specd.core.sampling import SamplingSettings
from specd.engine.batcher import AGAIN, Batcher
from specd.engine.loading import load_causal_lm
from specd.engine.session_cache import SessionStore
from target_service.calls import PrefillCall, VerifyCall
from target_service.runner import TargetModelRunner

GREEDY = SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, seed=0)
CHUNK = 4


@pytest.fixture(scope="module")
def runners(tiny_pair):
    """The same target twice: one batches with chunked catch-ups, the other runs each call alone."""
    loaded = load_causal_lm(tiny_pair[0], dtype="float32", device="cpu")
    return TargetModelRunner(loaded, SessionStore(16, 60.0), prefill_chunk=CHUNK), TargetModelRunner(loaded, SessionStore(16, 60.0), pack=False)


def _outcome(outcome):
    return outcome.accepted, outcome.next_token, outcome.is_bonus, outcome.cached_tokens


@pytest.mark.parametrize("long_call", ["verify", "prefill"])
def test_a_long_catch_up_runs_a_chunk_per_shared_forward_and_ends_as_alone(runners, long_call):
    chunked, alone = runners
    prompt = list(range(11, 34))  # 23 committed tokens to cache
    if long_call == "verify":
        long = VerifyCall("long", 0, prompt, [40, 41], [], GREEDY, True)
    else:
        long = PrefillCall("long", 0, prompt)
    short = [1, 2, 3]
    rounds = 0
    while True:
        step = VerifyCall("short", 0, list(short), [7], [], GREEDY, False)
        got_long, got_short = chunked.run_batch([long, step])
        want_short = alone.run_batch([step])[0]
        assert _outcome(got_short) == _outcome(want_short)  # the neighbour is served every forward
        short.extend(step.draft_tokens[: got_short.accepted] + [got_short.next_token])
        if got_long is not AGAIN:
            break
        rounds += 1
        assert len(chunked.sessions.open("long", 0).cached_tokens) == CHUNK * rounds
    # 23 tokens: 4 per shared forward until 4 or fewer are left to feed (with the verify's drafts).
    assert rounds == 5
    want_long = alone.run_batch([long])[0]
    if long_call == "verify":
        assert _outcome(got_long) == _outcome(want_long)
        assert got_long.logprobs == pytest.approx(want_long.logprobs, abs=1e-4)
    else:
        assert got_long[0] == want_long[0] == len(prompt) - 1
    for runner in runners:
        runner.end_session("long")
        runner.end_session("short")


def test_alone_a_long_catch_up_runs_in_one_forward(runners):
    chunked, _ = runners
    (outcome,) = chunked.run_batch([VerifyCall("solo", 0, list(range(11, 34)), [40], [], GREEDY, False)])
    assert outcome is not AGAIN and outcome.cached_tokens == 24  # 23 committed and the draft, in this one call
    chunked.end_session("solo")


def test_again_is_one_object_across_pickles():
    assert pickle.loads(pickle.dumps(AGAIN)) is AGAIN  # the tensor-parallel group pickles results


def _batcher(run_batch) -> tuple[Batcher, concurrent.futures.ThreadPoolExecutor, threading.Event]:
    model_thread = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    gate = threading.Event()
    model_thread.submit(gate.wait, 5)  # a forward under way: what is submitted below queues
    return Batcher(model_thread.submit, run_batch, lambda item: item[0], max_batch=4), model_thread, gate


def test_an_item_run_again_stays_first_in_line_until_it_is_done():
    batches: list[list[str]] = []
    left = {"a1": 2}  # a1 needs three forwards

    def run_batch(items):
        batches.append(list(items))
        results = []
        for item in items:
            if left.get(item, 0) > 0:
                left[item] -= 1
                results.append(AGAIN)
            else:
                results.append(item.upper())
        return results

    batcher, model_thread, gate = _batcher(run_batch)
    first, second, later = batcher.submit("a1"), batcher.submit("b1"), batcher.submit("b2")
    gate.set()
    assert (first.result(5), second.result(5), later.result(5)) == ("A1", "B1", "B2")
    assert batches == [["a1", "b1"], ["a1", "b2"], ["a1"]]
    model_thread.shutdown()


def _endless_again(calls: list, on_call=None):
    """A run_batch whose items never finish (bounded, so that a bug cannot spin for ever)."""

    def run_batch(items):
        calls.append(list(items))
        if on_call is not None:
            on_call(len(calls))
        return [AGAIN if len(calls) < 50 else "never done" for _ in items]

    return run_batch


def test_an_item_run_again_fails_when_its_session_ends_while_it_waits():
    calls: list = []
    hold = threading.Event()
    # Queued on the model thread during the first forward, so before the next turn.
    batcher, model_thread, gate = _batcher(_endless_again(calls, lambda n: n == 1 and model_thread.submit(hold.wait, 5)))
    future = batcher.submit("a1")
    gate.set()
    while not calls:
        threading.Event().wait(0.01)
    batcher.forget("a")  # EndSession, while a1 waits for its next forward
    hold.set()
    with pytest.raises(SessionNotFound):
        future.result(5)
    assert len(calls) == 1
    model_thread.shutdown()


def test_an_item_run_again_fails_when_its_session_ends_during_its_forward():
    calls: list = []
    in_forward, release = threading.Event(), threading.Event()
    batcher, model_thread, gate = _batcher(_endless_again(calls, lambda n: n == 1 and (in_forward.set(), release.wait(5))))
    future = batcher.submit("a1")
    gate.set()
    assert in_forward.wait(5)
    batcher.forget("a")  # EndSession, while a1's chunk is in the forward
    release.set()
    with pytest.raises(SessionNotFound):
        future.result(5)
    assert len(calls) == 1
    model_thread.shutdown()


def test_served_requests_with_long_prompts_side_by_side_decode_as_alone(tiny_pair):
    """Requests whose prompts arrive while others decode: their prompts are cached a chunk per
    forward, and every request's greedy output is what it gives alone."""
    from specd.v1 import coordinator_pb2 as pb
    from tests.conftest import CALL_TIMEOUT_S, assert_greedy_equal_or_near_tie, load_reference, request, running_stack

    modes = (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD)
    messages = [request(list(range(20 + i, 20 + i + 9 * (i + 1))), mode=modes[i % 3], max_new_tokens=12, k=3) for i in range(6)]
    model, _ = load_reference(tiny_pair[0])
    with running_stack(*tiny_pair, target_overrides={"prefill_chunk_tokens": CHUNK}, coordinator_overrides={"speculation_max_running": 0}) as stack:
        stub = stack.stub()
        alone = [list(stub.Generate(m, timeout=CALL_TIMEOUT_S).token_ids) for m in messages]
        runner, chunks = stack.target.servicer.runner, []
        run_batch = runner.run_batch

        def counted(calls, most_tokens=None):
            results = run_batch(calls, most_tokens)
            chunks.extend(r for r in results if r is AGAIN)
            return results

        runner.run_batch = counted
        together = [call.result() for call in [stub.Generate.future(m, timeout=CALL_TIMEOUT_S) for m in messages]]
    assert chunks, "no prompt was cached in chunks"
    for message, want, got in zip(messages, alone, together):
        assert_greedy_equal_or_near_tie(model, list(message.prompt_token_ids.ids), list(got.token_ids), want)
