"""coordinator/policy.py: a greedy sd request's K under load is the one that pays."""

from __future__ import annotations

import dataclasses

import pytest

from coordinator.policy import SpeculationPolicy
from coordinator.policy_measures import RoundCosts, expected_tokens
from coordinator.profiles import CPU
from specd.core.sampling import SamplingSettings
from specd.wire.modes import SD

ASKED = 4


class SpeculationPayoff(SpeculationPolicy):
    """A greedy sd request that asked K = 4, with `running` requests in their rounds."""

    def __init__(self, load: tuple[int, int], costs: RoundCosts):
        running, max_running = load
        profile = dataclasses.replace(CPU, speculation_max_running=max_running)
        super().__init__(SD, ASKED, SamplingSettings(), profile, running=lambda: running, costs=costs)
        self.costs = costs

    def k(self, asked: int) -> int:
        assert asked == ASKED
        return self.plan().num_draft

    def observe_round(self, num_draft: int, accepted: int, costs_ms) -> None:
        self.verified(num_draft, accepted, costs_ms)


def _load(running: int, max_running: int = 8) -> tuple[int, int]:
    return running, max_running


def _costs(draft_ms_per_token: float, verify_ms_by_tokens: dict[int, float]) -> RoundCosts:
    costs = RoundCosts()
    for tokens, ms in verify_ms_by_tokens.items():
        costs.observe(tokens - 1, draft_ms_per_token * (tokens - 1), ms)
    return costs


def test_expected_tokens_is_the_capped_geometric_mean():
    assert expected_tokens(0.0, 4) == pytest.approx(1.0)
    assert expected_tokens(1.0, 4) == pytest.approx(5.0)
    assert expected_tokens(0.5, 2) == pytest.approx(1 + 0.5 + 0.25)


def test_verify_cost_is_a_line_through_what_was_measured():
    costs = _costs(10.0, {1: 60.0, 5: 90.0})
    assert costs.verify_ms(1) == pytest.approx(60.0)
    assert costs.verify_ms(3) == pytest.approx(75.0)
    assert costs.verify_ms(9) == pytest.approx(120.0)
    assert costs.draft_ms(3) == pytest.approx(30.0)


def test_one_measured_token_count_extends_by_the_prior_slope():
    costs = _costs(10.0, {5: 90.0})  # 5 tokens at 1.5x one: one token is 60 ms
    assert costs.verify_ms(1) == pytest.approx(60.0)
    assert costs.verify_ms(3) == pytest.approx(75.0)


def test_more_tokens_never_verify_faster():
    costs = _costs(10.0, {1: 60.0, 5: 50.0})
    assert costs.verify_ms(5) == pytest.approx(60.0)


def _after_rounds(payoff: SpeculationPayoff, rounds: int, num_draft: int, accepted: int) -> SpeculationPayoff:
    for _ in range(rounds):
        payoff.observe_round(num_draft, accepted, None)
    return payoff


def test_alone_a_request_drafts_what_it_asked():
    payoff = _after_rounds(SpeculationPayoff(_load(running=1), _costs(200.0, {1: 60.0, 5: 90.0})), 10, 4, 0)
    assert payoff.k(4) == 4


def test_nothing_measured_yet_drafts_what_the_load_allows():
    assert SpeculationPayoff(_load(running=3), RoundCosts()).k(4) == 4
    assert SpeculationPayoff(_load(running=3, max_running=2), RoundCosts()).k(4) == 2


def test_under_load_a_draft_that_costs_more_than_it_saves_drafts_one_token():
    # Turning speculation off is the load policy's call; what pays never goes below one token.
    payoff = _after_rounds(SpeculationPayoff(_load(running=3), _costs(60.0, {1: 60.0, 5: 90.0})), 10, 4, 1)
    assert payoff.k(4) == 1


def test_under_load_a_cheap_draft_that_is_always_accepted_drafts_all_it_asked():
    payoff = _after_rounds(SpeculationPayoff(_load(running=3), _costs(2.0, {1: 60.0, 5: 65.0})), 10, 4, 4)
    assert payoff.k(4) == 4


def test_the_default_pair_on_cpu_drafts_one_or_two():
    # Measured on two cores: a 59 ms step, 10.5 ms a draft token, 5 tokens verified at 1.5x
    # a step; acceptance ~0.55 per token. K = 4 yields fewer tokens per second than plain steps.
    payoff = SpeculationPayoff(_load(running=2), _costs(10.5, {1: 59.0, 5: 88.5}))
    payoff.acceptance.accepted, payoff.acceptance.rejected = 55.0, 45.0
    k = payoff.k(4)
    assert k in (1, 2)
    # The choice is the best of 1..4 by the round's cost written out here independently.
    rate = lambda n: expected_tokens(payoff.acceptance.value, n) / (10.5 * n + 59.0 * (1 + 0.125 * n))
    assert rate(k) == max(rate(n) for n in range(1, 5))


def test_the_load_cap_bounds_what_pays():
    payoff = _after_rounds(SpeculationPayoff(_load(running=3, max_running=2), _costs(2.0, {1: 60.0, 5: 65.0})), 10, 2, 2)
    assert payoff.k(4) == 2  # half of 4 at 3 running of 2
    assert SpeculationPayoff(_load(running=5, max_running=2), payoff.costs).k(4) == 0


def test_low_acceptance_drafts_less_and_recovers_as_acceptance_does():
    payoff = SpeculationPayoff(_load(running=3), _costs(12.0, {1: 60.0, 5: 90.0}))
    for _ in range(20):
        payoff.observe_round(payoff.k(4), 0, None)
    assert payoff.k(4) == 1
    for _ in range(30):
        k = payoff.k(4)
        payoff.observe_round(k, k, None)
    assert payoff.k(4) == 4


def test_rounds_feed_the_shared_costs():
    costs = RoundCosts()
    first, second = SpeculationPayoff(_load(running=2), costs), SpeculationPayoff(_load(running=2), costs)
    first.observe_round(2, 1, (20.0, 70.0))
    second.observe_round(0, 0, (0.0, 60.0))
    assert costs.draft_ms(1) == pytest.approx(10.0)
    assert costs.verify_ms(1) == pytest.approx(60.0)
    assert costs.verify_ms(3) == pytest.approx(70.0)
