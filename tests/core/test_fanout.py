"""Geometric fan-out allocation (specd/core/fanout.py)."""

from __future__ import annotations

import pytest

from specd.core.fanout import acceptance_length_probs, allocate


def expected_hit_rate(rate: float, fanout: list[int], r: float) -> float:
    """The power-law model's hit rate: sum_k P(k) (1 - F_k^-r)."""
    probs = acceptance_length_probs(rate, len(fanout) - 1)
    return sum(p * (1.0 - f**-r) for p, f in zip(probs, fanout) if f > 0)

def test_acceptance_length_probs_sum_to_one():
    for rate in (0.0, 0.3, 0.8, 1.0):
        probs = acceptance_length_probs(rate, 5)
        assert len(probs) == 6
        assert abs(sum(probs) - 1.0) < 1e-12


@pytest.mark.parametrize("rate, num_draft, budget, r", [(0.8, 4, 16, 0.5), (0.5, 7, 24, 0.5), (0.9, 8, 30, 1.0), (0.3, 1, 5, 0.2)])
def test_allocation_sums_to_budget_and_follows_the_formula(rate, num_draft, budget, r):
    fanout = allocate(rate, num_draft, budget, vocab_size=1000, r=r)
    assert len(fanout) == num_draft + 1
    assert sum(fanout) == budget
    assert min(fanout) >= 1
    # The closed form F_k = F_0 a^(k/(1+r)), F_K = F_0 a^(K/(1+r)) (1-a)^(-1/(1+r)), scaled to B:
    ideal = [rate ** (k / (1 + r)) for k in range(num_draft)]
    ideal.append(rate ** (num_draft / (1 + r)) * (1 - rate) ** (-1 / (1 + r)))
    scale = budget / sum(ideal)
    for got, want in zip(fanout, ideal):
        # Largest-remainder rounding: within 1 of the ideal when every ideal share is >= 1.
        if min(ideal) * scale >= 1:
            assert abs(got - want * scale) < 1.0, (fanout, [w * scale for w in ideal])
    # P(k) falls with k below K, and so does F_k.
    assert fanout[:num_draft] == sorted(fanout[:num_draft], reverse=True)


def test_allocation_favours_likely_outcomes():
    # High acceptance: most mass on k = K; low acceptance: on k = 0.
    high = allocate(0.9, 4, 20, vocab_size=1000, r=0.5)
    low = allocate(0.2, 4, 20, vocab_size=1000, r=0.5)
    assert high[-1] == max(high)
    assert low[0] == max(low)
    assert low[:4] == sorted(low[:4], reverse=True)


def test_small_budget_goes_to_the_most_likely_outcomes():
    assert allocate(0.2, 4, 0, vocab_size=100, r=0.5) == [0, 0, 0, 0, 0]
    assert allocate(0.2, 4, 2, vocab_size=100, r=0.5) == [1, 1, 0, 0, 0]
    assert allocate(0.95, 4, 1, vocab_size=100, r=0.5) == [0, 0, 0, 0, 1]


def test_vocabulary_caps_fanout():
    # k < K excludes the drafted token: at most V-1 guesses there, V at k = K.
    fanout = allocate(0.5, 2, 100, vocab_size=4, r=0.5)
    assert fanout == [3, 3, 4]


def test_more_budget_raises_the_modelled_hit_rate():
    rates = [expected_hit_rate(0.7, allocate(0.7, 4, b, 1000, 0.5), 0.5) for b in (5, 10, 20, 40)]
    assert rates == sorted(rates)
    assert rates[0] == 0.0  # one branch per outcome: the power law gives 1 - 1^-r = 0
