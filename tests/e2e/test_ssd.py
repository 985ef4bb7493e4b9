"""SSD end to end over real gRPC: exact greedy output on the hit and miss paths with both
backups, for the tiny models (the default pair: tests/e2e/test_default_pair.py), cache statistics,
and a seeded sampled run with Saguaro sampling.

Greedy output must equal the target decoding alone (the exactness contract, README), except at a near-tie that the
test shows (the target's top-2 logit gap below 1e-4 at the first divergence).
"""

from __future__ import annotations

import contextlib

import grpc
import pytest

from specd.v1 import coordinator_pb2 as pb
from specd.v1 import coordinator_pb2_grpc
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)

MAX_NEW = 40
PROMPTS = ["def add(a, b):", "for i in range(10):\n", "class Point:\n    def"]
SSD = pb.SPECULATION_MODE_SSD


def _reference(folder: str):
    model, tokenizer = load_reference(folder)
    prompts = {text: tokenizer.encode(text, add_special_tokens=True) for text in PROMPTS}
    greedy = {text: greedy_reference(model, ids, MAX_NEW) for text, ids in prompts.items()}
    return model, prompts, greedy


@pytest.fixture(scope="module")
def reference(tiny_pair):
    return _reference(tiny_pair[0])


# (budget, backup): the hit path with both backups, and forced misses (budget 0) with both, at
# exactly the K and budget asked.
STACKS = {
    "jit": dict(ssd_budget=16, ssd_backup="jit"),
    # Tiny models verify faster than the draft builds a tree: wait for it, or ngram never hits.
    "ngram": dict(ssd_budget=16, ssd_backup="ngram", ssd_wait_ms=5000.0),
    "miss-jit": dict(ssd_budget=0, ssd_backup="jit"),
    "miss-ngram": dict(ssd_budget=0, ssd_backup="ngram"),
}


@contextlib.contextmanager
def _stacks(target: str, draft: str):
    """One target and draft shared by coordinators with different ssd settings."""
    with running_stack(target, draft, coordinator_overrides=STACKS["jit"]) as stack:
        stubs = {"jit": stack.stub()}
        extra = []
        for name, overrides in STACKS.items():
            if name != "jit":
                stack.coordinator_overrides = overrides
                extra.append(stack.run(stack._start_coordinator()))
                stubs[name] = coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{extra[-1].port}"))
        yield stubs
        for service in extra:
            stack.run(service.stop(0), timeout=10)


@pytest.fixture(scope="module")
def stacks(tiny_pair):
    with _stacks(*tiny_pair) as stubs:
        yield stubs


@pytest.mark.parametrize("setting", list(STACKS))
@pytest.mark.parametrize("k", [1, 4, 8])
def test_greedy_ssd_equals_target_alone(stacks, reference, setting, k):
    model, prompts, greedy = reference
    hits = misses = 0
    for text in PROMPTS:
        message = request(prompts[text], mode=SSD, k=k, max_new_tokens=MAX_NEW)
        response = stacks[setting].Generate(message, timeout=CALL_TIMEOUT_S)
        stats = response.stats
        assert response.usage.completion_tokens == MAX_NEW
        assert stats.mode == SSD, stats
        assert not stats.fallback_reason
        assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), greedy[text])
        # Every round looks its draft up but the first (a Propose) and, when only one token is
        # left, the last (a plain decode step).
        assert stats.rounds - 2 <= stats.cache_hits + stats.cache_misses <= stats.rounds - 1
        assert stats.cache_hit_rate == pytest.approx(stats.cache_hits / max(1, stats.cache_hits + stats.cache_misses))
        assert len(stats.accepted_per_position) <= k
        assert stats.draft_tokens <= k * stats.rounds
        hits += stats.cache_hits
        misses += stats.cache_misses
    if setting.startswith("miss"):
        assert hits == 0 and misses > 0  # budget 0: no cache, every round takes the backup
    else:
        assert hits > 0, f"no cache hit over {len(PROMPTS)} prompts"


def test_sampled_ssd_with_saguaro_completes(tiny_pair):
    overrides = dict(ssd_budget=12, ssd_backup="jit", ssd_saguaro_c=0.3)
    with running_stack(*tiny_pair, coordinator_overrides=overrides) as stack:
        stub = stack.stub()
        message = request([5, 17, 42, 99], mode=SSD, k=4, max_new_tokens=48, temperature=1.0, seed=42)
        message.sampling.top_p = 0.9
        response = stub.Generate(message, timeout=CALL_TIMEOUT_S)
    stats = response.stats
    assert response.usage.completion_tokens == 48
    assert stats.mode == SSD and stats.seed == 42 and not stats.fallback_reason
    assert 0 < stats.draft_tokens and 0 <= stats.accepted_tokens <= stats.draft_tokens
    assert 0.0 <= stats.acceptance_rate <= 1.0
    assert stats.rounds - 2 <= stats.cache_hits + stats.cache_misses <= stats.rounds - 1
    assert stats.cache_hits > 0
    assert stats.draft_wait_ms >= 0.0


def test_auto_runs_ssd_with_a_draft_and_target_only_without(stacks, tiny_pair, reference):
    model, prompts, greedy = reference
    text = PROMPTS[0]
    response = stacks["jit"].Generate(
        request(prompts[text], mode=pb.SPECULATION_MODE_AUTO, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S
    )
    assert response.stats.mode == SSD
    assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), greedy[text])
    with running_stack(tiny_pair[0], None) as stack:
        response = stack.stub().Generate(
            request(prompts[text], mode=pb.SPECULATION_MODE_AUTO, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S
        )
    assert response.stats.mode == pb.SPECULATION_MODE_OFF
    assert list(response.token_ids) == greedy[text]


def test_ssd_survives_the_draft_going_away_and_coming_back(tiny_pair, reference):
    """No draft: target-only rounds with the same output, said in the stats; back: ssd again,
    with the fresh worker's sessions re-sent from position 0."""
    import time

    model, prompts, greedy = reference
    text = PROMPTS[1]
    message = request(prompts[text], mode=SSD, k=4, max_new_tokens=MAX_NEW)
    with running_stack(*tiny_pair, coordinator_overrides=dict(ssd_backup="jit")) as stack:
        stub = stack.stub()
        assert stub.Generate(message, timeout=CALL_TIMEOUT_S).stats.mode == SSD
        stack.stop_draft()
        away = stub.Generate(message, timeout=CALL_TIMEOUT_S)
        assert away.stats.mode == pb.SPECULATION_MODE_OFF and away.stats.fallback_reason
        assert_greedy_equal_or_near_tie(model, prompts[text], list(away.token_ids), greedy[text])
        stack.restart_draft()
        time.sleep(0.5)  # past the coordinator's draft_retry_s
        back = stub.Generate(message, timeout=CALL_TIMEOUT_S)
        assert back.stats.mode == SSD and back.stats.cache_hits > 0
        assert_greedy_equal_or_near_tie(model, prompts[text], list(back.token_ids), greedy[text])
