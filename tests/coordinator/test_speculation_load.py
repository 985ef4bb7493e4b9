"""Speculation under load (coordinator/policy.py): past --speculation-max-running requests a
request drafts half its K, past twice that none, round by round; while it drafts nothing the
draft is not called at all, and when load falls it drafts again after catching up in one call.
Output is exact throughout."""

from __future__ import annotations

import pytest

from coordinator.policy import UNDER_LOAD, load_share, scaled
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)
from tests.stack import count_calls
from tests.tracing import in_memory_tracing, round_attributes

PROMPT = [5, 17, 42, 99, 7, 3, 11]
K, NEW = 4, 32


def test_the_share_falls_with_the_requests_running():
    seen = {}
    for running in (1, 2, 3, 4, 5, 9):
        share = load_share(running, 2)
        seen[running] = (scaled(4, share), scaled(8, share), scaled(1, share))
    assert seen == {1: (4, 8, 1), 2: (4, 8, 1), 3: (2, 4, 1), 4: (2, 4, 1), 5: (0, 0, 0), 9: (0, 0, 0)}
    assert scaled(4, load_share(100, 0)) == 4  # 0: no limit


@pytest.fixture(scope="module")
def loaded_stack(tiny_pair):
    """A stack whose requests see `forced[0]` requests running, whatever really runs (a
    callable there is asked each round), and its spans' in-memory exporters."""
    forced: list = [1]
    providers, exporters = in_memory_tracing()

    def running() -> int:
        return forced[0]() if callable(forced[0]) else forced[0]

    with running_stack(*tiny_pair, coordinator_overrides={"speculation_max_running": 1}, tracer_providers=providers) as stack:
        stack.coordinator.servicer.generator.running = running
        yield stack, forced, exporters


@pytest.fixture(scope="module")
def reference(tiny_pair):
    model, _ = load_reference(tiny_pair[0])
    return model, greedy_reference(model, PROMPT, NEW)


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD])
def test_a_loaded_server_decodes_target_only_without_calling_the_draft(loaded_stack, reference, mode):
    stack, forced, exporters = loaded_stack
    model, want = reference
    forced[0] = 3  # past twice the limit of 1
    runner = stack.draft.servicer.runner
    proposes, speculates = count_calls(runner, "propose_job"), count_calls(runner, "speculate_job")
    try:
        response = stack.stub().Generate(request(PROMPT, mode=mode, k=K, max_new_tokens=NEW), timeout=CALL_TIMEOUT_S)
    finally:
        del runner.propose_job, runner.speculate_job  # the class's own again
    assert response.stats.mode == pb.SPECULATION_MODE_OFF and response.stats.draft_tokens == 0
    assert not response.stats.fallback_reason  # a policy, not a failure
    assert proposes[0] == speculates[0] == 0
    assert_greedy_equal_or_near_tie(model, PROMPT, list(response.token_ids), want)
    # Every round's span says why it drafted nothing (the last one could draft nothing anyway).
    rounds = round_attributes(exporters["coordinator"], response.trace_id)
    assert len(rounds) == response.stats.rounds
    assert all(r.get("specd.round.target_only") == UNDER_LOAD for r in rounds[:-1])


def test_a_busier_server_drafts_half_of_k(loaded_stack, reference):
    stack, forced, _ = loaded_stack
    model, want = reference
    forced[0] = 2  # past the limit, within twice it
    response = stack.stub().Generate(request(PROMPT, k=K, max_new_tokens=NEW), timeout=CALL_TIMEOUT_S)
    stats = response.stats
    assert stats.mode == pb.SPECULATION_MODE_SD and 0 < stats.draft_tokens <= (K // 2) * stats.rounds
    assert_greedy_equal_or_near_tie(model, PROMPT, list(response.token_ids), want)


def test_speculation_resumes_when_the_load_falls(loaded_stack, reference):
    stack, forced, _ = loaded_stack
    model, want = reference
    asked = iter([3] * 6)  # six rounds target-only, which the draft never sees; then load falls
    forced[0] = lambda: next(asked, 1)
    messages = list(stack.stub().GenerateStream(request(PROMPT, k=K, max_new_tokens=NEW), timeout=CALL_TIMEOUT_S))
    stats = messages[-1].stats
    tokens = [t for m in messages for t in m.token_ids]
    assert stats.rounds < NEW - 6  # the rounds after the first six took more than one token each
    assert stats.mode == pb.SPECULATION_MODE_SD and stats.draft_tokens > 0 and not stats.fallback_reason
    assert_greedy_equal_or_near_tie(model, PROMPT, tokens, want)


def test_a_seeded_sampled_sd_request_keeps_its_k_and_its_output_under_load(loaded_stack):
    """Which positions a sampled sd request drafts decides its output for a seed: load must not
    change it, or the seed would not reproduce the output."""
    stack, forced, _ = loaded_stack
    message = request(PROMPT, k=K, max_new_tokens=NEW, temperature=1.0, seed=42)
    forced[0] = 1
    quiet = stack.stub().Generate(message, timeout=CALL_TIMEOUT_S)
    forced[0] = 3
    busy = stack.stub().Generate(message, timeout=CALL_TIMEOUT_S)
    assert busy.stats.mode == pb.SPECULATION_MODE_SD and busy.stats.draft_tokens == quiet.stats.draft_tokens > 0
    assert list(busy.token_ids) == list(quiet.token_ids)
