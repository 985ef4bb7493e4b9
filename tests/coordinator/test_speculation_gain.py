"""coordinator/policy.py, coordinator/policy_measures.py: an `auto` request measures whether
speculation pays for it (GainComparison), within what the load allows."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.policy import NO_GAIN, UNDER_LOAD, SpeculationPolicy
from coordinator.policy_measures import (
    EARLY_ROUNDS,
    FIRST_WINDOW,
    MAX_WINDOW,
    OFF_PROBE,
    SPECULATION_PROBE,
    GainComparison,
)
from coordinator.profiles import CPU
from specd.core.sampling import SamplingSettings
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)
from tests.tracing import in_memory_tracing, round_attributes

K = 4
SPECULATIVE_MS, PLAIN_MS = 60.0, 40.0  # a speculative round and a target-only one
FEW_TOKENS = CPU.few_tokens


class SpeculationGain:
    """An auto ssd request's policy asking K = 4, driven round by round as its loop drives it."""

    def __init__(self, max_running: int = 0, running=lambda: 1, first_window: int | None = None):
        profile = dataclasses.replace(CPU, speculation_max_running=max_running)
        self.policy = SpeculationPolicy("ssd", K, SamplingSettings(), profile, running=running, auto=True)
        self.policy.gain = GainComparison(profile.few_tokens, first_window)

    def k(self, asked: int) -> int:
        assert asked == K
        return self.policy.k

    def budget(self, asked: int) -> int:
        assert asked == self.policy.profile.ssd_budget
        return self.policy.budget

    def target_only(self) -> str:
        return self.policy.plan().target_only if self.policy.k <= 0 else ""

    def observe(self, drafted: bool, tokens: float, wall_ms: float) -> None:
        self.policy.gain.observe(drafted, tokens, wall_ms)


def _run(gain: SpeculationGain, rounds: int, speculative_tokens: float, speculative_ms: float = SPECULATIVE_MS) -> list[bool]:
    """Rounds as the request's loop runs them (drafting while k > 0); which of them drafted."""
    drafted = []
    for _ in range(rounds):
        speculates = gain.k(K) > 0
        drafted.append(speculates)
        tokens, ms = (speculative_tokens, speculative_ms) if speculates else (1, PLAIN_MS)
        gain.observe(speculates, tokens, ms)
    return drafted


def test_speculation_that_pays_is_probed_ever_more_rarely():
    gain = SpeculationGain()
    drafted = _run(gain, 2000, speculative_tokens=3)  # 50 tokens/s speculating against 25 plain
    plain_rounds = [i for i, d in enumerate(drafted) if not d]
    assert plain_rounds[:OFF_PROBE] == list(range(FIRST_WINDOW, FIRST_WINDOW + OFF_PROBE))  # the first probe
    assert len(plain_rounds) < 0.05 * len(drafted)
    longest = max(len(run) for run in "".join("s" if d else "." for d in drafted).split("."))
    assert longest == MAX_WINDOW


def test_speculation_that_does_not_pay_turns_itself_off_and_is_probed_again():
    gain = SpeculationGain()
    drafted = _run(gain, 2000, speculative_tokens=1.6, speculative_ms=70.0)  # 22.9 tokens/s speculating against 25 plain
    assert all(drafted[:FIRST_WINDOW]) and not any(drafted[FIRST_WINDOW : FIRST_WINDOW + OFF_PROBE])
    assert sum(drafted) < 0.1 * len(drafted)
    after = drafted[FIRST_WINDOW + OFF_PROBE :]
    assert not any(after[:FIRST_WINDOW]) and all(after[FIRST_WINDOW : FIRST_WINDOW + SPECULATION_PROBE])  # probed again
    assert not after[FIRST_WINDOW + SPECULATION_PROBE]


def test_speculation_that_yields_few_tokens_is_probed_after_a_few_rounds():
    gain = SpeculationGain()
    drafted = _run(gain, 2000, speculative_tokens=1.2)  # 20 tokens/s speculating against 25 plain
    early = 1 + EARLY_ROUNDS  # the switch's round, then the measured ones
    assert all(drafted[:early]) and not any(drafted[early : early + OFF_PROBE])
    after = drafted[early + OFF_PROBE :]
    assert not any(after[:FIRST_WINDOW]) and all(after[FIRST_WINDOW : FIRST_WINDOW + early])  # the probe, cut short too
    assert not after[FIRST_WINDOW + early]
    assert sum(drafted) < 0.03 * len(drafted)


def test_speculation_that_yields_few_tokens_but_wins_runs_its_stretches():
    gain = SpeculationGain()
    drafted = _run(gain, 2000, speculative_tokens=FEW_TOKENS - 0.2, speculative_ms=20.0)  # a fast verify: 65 tokens/s against 25
    early = 1 + EARLY_ROUNDS
    assert all(drafted[:early]) and not any(drafted[early : early + OFF_PROBE])  # probed early, then measured to win
    longest = max(len(run) for run in "".join("s" if d else "." for d in drafted).split("."))
    assert longest == MAX_WINDOW


def test_a_request_whose_text_changes_follows_it():
    gain = SpeculationGain()
    _run(gain, 600, speculative_tokens=1.2)
    assert not gain.k(K)
    drafted = _run(gain, 1200, speculative_tokens=3.5)  # now the draft is right: it speculates again
    assert sum(drafted[-400:]) > 380


def test_the_load_policy_still_caps_it():
    gain = SpeculationGain(1, running=lambda: 5)  # past twice the limit: no drafting
    assert gain.k(K) == 0 and gain.budget(CPU.ssd_budget) == 0
    assert gain.target_only() == UNDER_LOAD
    halved = SpeculationGain(1, running=lambda: 2)
    assert halved.k(K) == K // 2 and halved.target_only() == ""


def test_it_says_why_a_round_drafts_nothing():
    gain = SpeculationGain(first_window=3)
    assert gain.target_only() == ""
    _run(gain, 3, speculative_tokens=3)
    assert gain.k(K) == 0 and gain.target_only() == NO_GAIN  # the probe of target-only decoding
    busy = SpeculationGain(1, running=lambda: 5, first_window=3)
    _run(busy, 3, speculative_tokens=3)
    assert busy.target_only() == UNDER_LOAD  # no round would draft, whatever the request measured


def test_the_first_round_of_a_stretch_is_not_measured():
    gain = SpeculationGain(first_window=3)
    gain.observe(True, 100, 1.0)  # the switch's round: a huge rate that must not count
    gain.observe(True, 1, 100.0)
    gain.observe(True, 1, 100.0)
    assert gain.k(K) == 0  # the probe
    for _ in range(OFF_PROBE):
        gain.observe(False, 1, 40.0)
    assert gain.k(K) == 0, "0.01 tokens/ms speculating lost to 0.025 plain"


@pytest.mark.parametrize("penalty", [1.0, 1.5])
def test_auto_requests_switching_between_kinds_stay_exact(tiny_pair, monkeypatch, penalty):
    """Windows of a few rounds, so that an auto request switches many times in 48 tokens: its
    greedy output is the target's alone whichever rounds drafted."""
    import coordinator.policy_measures as policy_measures

    monkeypatch.setattr(policy_measures, "FIRST_WINDOW", 3)
    monkeypatch.setattr(policy_measures, "OFF_PROBE", 2)
    monkeypatch.setattr(policy_measures, "SPECULATION_PROBE", 2)
    model, tokenizer = load_reference(tiny_pair[0])
    providers, exporters = in_memory_tracing()
    with running_stack(*tiny_pair, tracer_providers=providers) as stack:
        stub = stack.stub()
        for text in ("def add(a, b):", "The quick brown fox"):
            ids = tokenizer.encode(text)
            message = request(ids, mode=pb.SPECULATION_MODE_AUTO, k=K, max_new_tokens=48)
            message.sampling.repetition_penalty = penalty
            response = stub.Generate(message, timeout=CALL_TIMEOUT_S)
            want = greedy_reference(model, ids, 48, repetition_penalty=penalty)
            assert_greedy_equal_or_near_tie(model, ids, list(response.token_ids), want, repetition_penalty=penalty)
            assert 0 < response.stats.draft_tokens < K * (response.stats.rounds - 1), "no round, or every round, drafted"
            # Each round the request's measurement took target-only says so on its span.
            rounds = round_attributes(exporters["coordinator"], response.trace_id)
            assert len(rounds) == response.stats.rounds
            paused = [r for r in rounds if r.get("specd.round.target_only") == NO_GAIN]
            assert paused and all(r["specd.round.num_draft"] == 0 for r in paused)
            assert all("specd.round.target_only" not in r for r in rounds if r["specd.round.num_draft"] > 0)
