"""Geometric fan-out: how many bonus-token guesses the speculation cache holds per outcome.

A verification outcome is (k accepted, t*), k in 0..K. With per-token acceptance a, the
acceptance length is capped-geometric: P(k) = a^k (1 - a) for k < K and P(K) = a^K.
Modelling the miss rate at fan-out F as a power law, 1 - p_hit(F) = F^-r, the allocation
of a budget of B branches that maximises the hit rate is F_k proportional to P(k)^(1/(1+r))
(Kumar, Dao, May 2026, section 4): F_k = F_0 a^(k/(1+r)) for k < K and
F_K = F_0 a^(K/(1+r)) (1 - a)^(-1/(1+r)).
"""

from __future__ import annotations

import math

# Keep P(k) positive at both ends: a = 0 or 1 would put the whole budget on one outcome.
_MIN_RATE, _MAX_RATE = 0.02, 0.98


def acceptance_length_probs(rate: float, num_draft: int) -> list[float]:
    """P(k) for k in 0..K under capped-geometric acceptance with per-token rate `rate`."""
    a = min(max(rate, _MIN_RATE), _MAX_RATE)
    return [a**k * (1.0 - a) for k in range(num_draft)] + [a**num_draft]


def allocate(rate: float, num_draft: int, budget: int, vocab_size: int, r: float) -> list[int]:
    """F_0..F_K: branches per outcome k, summing to min(budget, what the vocabulary allows).

    F_k >= 1 for every k when budget >= K+1; with less, the most likely outcomes get one
    each. A guess at k < K excludes the drafted token d_{k+1} (a rejected token is never
    t*), so F_k <= V-1 there and F_K <= V.
    """
    assert num_draft >= 0 and budget >= 0 and vocab_size >= 2 and r >= 0
    caps = [vocab_size - 1] * num_draft + [vocab_size]
    budget = min(budget, sum(caps))
    weights = [p ** (1.0 / (1.0 + r)) for p in acceptance_length_probs(rate, num_draft)]
    if budget <= len(weights):
        # Not enough for one branch per outcome: the most likely outcomes first.
        order = sorted(range(len(weights)), key=lambda k: -weights[k])
        chosen = set(order[:budget])
        return [1 if k in chosen else 0 for k in range(len(weights))]
    # Water-filling: outcomes whose share falls below one branch get exactly one, outcomes
    # whose share exceeds their cap get the cap, the rest share what is left in proportion
    # to their weights; then largest-remainder rounding keeps the sum at the budget.
    fixed: dict[int, int] = {}
    while True:
        free = [k for k in range(len(weights)) if k not in fixed]
        if not free:
            break
        left = budget - sum(fixed.values())
        total = sum(weights[k] for k in free)
        ideal = {k: weights[k] / total * left for k in free}
        low = [k for k in free if ideal[k] < 1.0]
        high = [k for k in free if ideal[k] > caps[k]]
        if not low and not high:
            break
        # Lows first: fixing them only lowers the others' shares, so none is fixed twice.
        fixed.update({k: 1 for k in low} if low else {k: caps[k] for k in high})
    fanout = [fixed.get(k, 0) for k in range(len(weights))]
    for k in free:
        fanout[k] = int(math.floor(ideal[k]))
    rest = budget - sum(fanout)
    for k in sorted(free, key=lambda k: (-(ideal[k] - fanout[k]), k))[:rest]:
        fanout[k] += 1
    # Caps can strand budget on outcomes fixed at one branch (tiny vocabularies): top up
    # where a branch adds the most weight per branch.
    while (rest := budget - sum(fanout)) > 0:
        room = [k for k in range(len(weights)) if fanout[k] < caps[k]]
        fanout[max(room, key=lambda k: (weights[k] / (fanout[k] + 1), -k))] += 1
    return fanout
