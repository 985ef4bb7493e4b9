"""A time budget for the target's forwards (--prefill-chunk-ms): the pacer turns it into a number
of tokens from the ms per token recent forwards took, and the runner cuts catch-ups to fit it,
alone or shared. Outcomes must not change: a cut call caches a chunk and runs again (AGAIN)."""

from __future__ import annotations

import pytest

from specd.core.config import ConfigError
from specd.core.sampling import SamplingSettings
from specd.engine.batcher import AGAIN
from specd.engine.loading import load_causal_lm
from specd.engine.session_cache import SessionStore
from target_service.calls import PrefillCall, VerifyCall
from target_service.config import TargetConfig
from target_service.prefill_pacing import MIN_TOKENS, PrefillPacer
from target_service.runner import MIN_CHUNK, ForwardCost, TargetModelRunner

GREEDY = SamplingSettings(temperature=0.0, top_k=0, top_p=1.0, seed=0)


def test_no_budget_sets_no_limit():
    pacer = PrefillPacer(0.0, 256)
    pacer.observe(ForwardCost(100, 100, 500.0))
    assert pacer.most_tokens() is None


def test_the_budget_in_tokens_follows_the_latest_forwards_that_cached_a_prompt():
    pacer = PrefillPacer(200.0, 256)
    assert pacer.most_tokens() == 256  # nothing measured yet
    pacer.observe(ForwardCost(100, 96, 400.0))  # 4 ms a token
    assert pacer.most_tokens() == 50
    pacer.observe(ForwardCost(80, 16, 120.0))  # 16 sessions' verifies: cheap a token, but no prompt
    assert pacer.most_tokens() == 50
    pacer.observe(ForwardCost(100, 100, 200.0))  # 2 ms a token: the estimate moves halfway, to 3
    assert pacer.most_tokens() == 66
    pacer.observe(ForwardCost(40, 40, 4000.0))  # a slow stretch (100 ms a token): never fewer than MIN_TOKENS
    assert pacer.most_tokens() == MIN_TOKENS


def test_budget_setting_is_checked():
    with pytest.raises(ConfigError, match="prefill-chunk-ms"):
        TargetConfig(prefill_chunk_ms=-1.0).validate()


@pytest.fixture(scope="module")
def runners(tiny_pair):
    """The same target twice: one cuts catch-ups by the limit it is given, the other runs each call whole."""
    loaded = load_causal_lm(tiny_pair[0], dtype="float32", device="cpu")
    return TargetModelRunner(loaded, SessionStore(16, 60.0)), TargetModelRunner(loaded, SessionStore(16, 60.0), pack=False)


def _outcome(outcome):
    return outcome.accepted, outcome.next_token, outcome.is_bonus, outcome.cached_tokens


@pytest.mark.parametrize("long_call", ["verify", "prefill"])
def test_alone_a_long_catch_up_is_cut_to_the_limit(runners, long_call):
    cut, whole = runners
    prompt = list(range(11, 111))  # 100 committed tokens
    call = VerifyCall("long", 0, prompt, [40, 41], [], GREEDY, True) if long_call == "verify" else PrefillCall("long", 0, prompt)
    forwards = []
    while (outcome := cut.run_batch([call], 30)[0]) is AGAIN:
        forwards.append(cut.last_forward.fed_tokens)
    forwards.append(cut.last_forward.fed_tokens)
    want = whole.run_batch([call])[0]
    if long_call == "verify":
        assert forwards == [30, 30, 30, 12]  # 100 committed tokens, then the last 10 with the 2 drafts
        assert _outcome(outcome) == _outcome(want)
        assert outcome.logprobs == pytest.approx(want.logprobs, abs=1e-4)
    else:
        assert forwards == [30, 30, 30, 9]  # 99 to cache: the last committed token is the next verify's
        assert outcome[0] == want[0] == 99
    for runner in runners:
        runner.end_session("long")


def test_shared_the_short_feeds_go_whole_and_long_catch_ups_share_the_rest(runners):
    cut, whole = runners
    calls = [
        PrefillCall("p", 0, list(range(200, 300))),  # 99 to cache
        VerifyCall("short", 0, [1, 2, 3], [7], [], GREEDY, False),  # 4 tokens: whole
        VerifyCall("v", 0, list(range(300, 400)), [5, 6], [], GREEDY, False),  # 100 committed to feed
    ]
    results = cut.run_batch(calls, 60)
    assert results[0] is AGAIN and results[2] is AGAIN
    assert _outcome(results[1]) == _outcome(whole.run_batch([calls[1]])[0])
    assert len(cut.sessions.open("p", 0).cached_tokens) == 28  # (60 - 4) / 2
    assert len(cut.sessions.open("v", 0).cached_tokens) == 28
    assert cut.last_forward.fed_tokens == 60 and cut.last_forward.committed_tokens == 3 + 28 + 28
    # However full the forward, a cut catch-up progresses by MIN_CHUNK.
    results = cut.run_batch(calls[:1] + calls[2:], 1)
    assert results == [AGAIN, AGAIN]
    assert len(cut.sessions.open("p", 0).cached_tokens) == 28 + MIN_CHUNK
    for runner in runners:
        for session in ("p", "short", "v"):
            runner.end_session(session)


def test_served_prompts_cut_by_a_time_budget_decode_as_uncut(tiny_pair):
    """Through the target worker, with a budget far under any forward's time: a request alone on
    the worker has its prompt cached whole; requests side by side have theirs cached MIN_TOKENS
    at a time, and every mode's greedy output is what it is uncut. Every forward is in the
    target's metrics, those that only cached chunks too."""
    from specd.v1 import coordinator_pb2 as pb
    from tests.conftest import CALL_TIMEOUT_S, assert_greedy_equal_or_near_tie, load_reference, request, running_stack
    from tests.stack import wait_for

    modes = (pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD)
    messages = [request(list(range(30 + i, 30 + i + 70 + 20 * i)), mode=modes[i], max_new_tokens=12, k=3) for i in range(3)]
    with running_stack(*tiny_pair) as stack:
        uncut = [list(stack.stub().Generate(m, timeout=CALL_TIMEOUT_S).token_ids) for m in messages]
    with running_stack(*tiny_pair, target_overrides={"prefill_chunk_ms": 0.001, "metrics_port": 0}) as stack:
        stub, runner, batches, forwards = stack.stub(), stack.target.servicer.runner, [], []
        run_batch = runner.run_batch

        def logged(calls, most_tokens=None):
            results = run_batch(calls, most_tokens)
            batches.append((most_tokens, sum(result is AGAIN for result in results)))
            forwards.append(runner.last_forward is not None)
            return results

        runner.run_batch = logged
        alone = list(stub.Generate(messages[2], timeout=CALL_TIMEOUT_S).token_ids)
        alone_batches = len(batches)
        together = [list(call.result().token_ids) for call in [stub.Generate.future(m, timeout=CALL_TIMEOUT_S) for m in messages]]
        registry = stack.target.metrics.registry

        def observed() -> float:
            return sum(registry.get_sample_value("specd_forward_seconds_count", {"op": op}) or 0 for op in ("prefill", "verify"))

        # Every forward in the metrics, those that only cached chunks too (a forward still running
        # when the last answer came is counted once it ends).
        assert wait_for(lambda: observed() == sum(forwards), 5.0), (observed(), sum(forwards))
    assert batches[:alone_batches] == [(None, 0)] * alone_batches  # alone: no limit, nothing cut
    cut = [most_tokens for most_tokens, again in batches[alone_batches:] if again]
    assert cut and set(cut) == {MIN_TOKENS}, batches
    model, _ = load_reference(tiny_pair[0])
    for message, want, got in zip(messages + messages[2:], uncut + uncut[2:], together + [alone]):
        assert_greedy_equal_or_near_tie(model, list(message.prompt_token_ids.ids), got, want)
