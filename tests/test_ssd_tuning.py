"""SSD's adaptive sizing (coordinator/ssd_tuning.py): K from acceptance, B from measured throughput."""

from __future__ import annotations

import random

from coordinator.ssd_tuning import Sizing, Tuning


def _run(sizing: Sizing, cost, rounds: int) -> list[int]:
    chosen = []
    for _ in range(rounds):
        budget = sizing.budget
        sizing.observe(budget, cost(budget), tokens=4)
        chosen.append(sizing.levels[sizing.current])
    return chosen


def test_budget_climbs_down_to_the_fastest_level():
    # ms per round is lowest at B = 4 (a machine where the tree competes with verification).
    sizing = Sizing(max_budget=16)
    assert sizing.budget == 16
    chosen = _run(sizing, lambda b: 40.0 + abs(b - 4) * 2.0, 400)
    assert chosen[-1] == 4
    assert sizing.levels == [0, 1, 2, 4, 8, 12, 16]


def test_budget_stays_at_the_top_when_more_branches_pay():
    sizing = Sizing(max_budget=16)
    chosen = _run(sizing, lambda b: 60.0 - b, 300)
    assert chosen[-1] == 16


def test_zero_budget_has_one_level():
    sizing = Sizing(max_budget=0)
    assert _run(sizing, lambda b: 10.0, 50)[-1] == 0 and sizing.budget == 0


def test_k_follows_acceptance():
    tuning = Tuning(max_k=8, max_budget=16, adaptive=True)
    for _ in range(30):
        tuning.observe_round(8, 8)  # everything accepted: a -> 1, K -> max
    assert tuning.k == 8
    for _ in range(80):
        tuning.observe_round(8, 0)  # nothing accepted: K -> 1
    assert tuning.k == 1
    assert Tuning(max_k=5, max_budget=16, adaptive=False).k == 5


def test_budget_finds_zero_behind_a_plateau():
    # Measured on a shared 2-core box: any tree beside Verify slowed it alike; only B = 0 (sd) won.
    sizing = Sizing(max_budget=16)
    # The third probe goes to 0; each probe is judged over its 16 rounds and 16 more after it.
    chosen = _run(sizing, lambda b: 50.0 if b == 0 else 65.0, 300)
    assert chosen[-1] == 0
    # And back up when speculation pays again.
    chosen = _run(sizing, lambda b: 65.0 if b == 0 else 50.0 - b / 8, 300)
    assert chosen[-1] > 0


def test_budget_zero_must_win_clearly_to_be_adopted():
    # A few percent ahead at 0 is within what the text alone does to a probe's 16 rounds.
    sizing = Sizing(max_budget=16)
    chosen = _run(sizing, lambda b: 48.0 if b == 0 else 50.0, 600)
    assert 0 not in chosen
    chosen = _run(sizing, lambda b: 43.0 if b == 0 else 50.0, 600)
    assert chosen[-1] == 0


def test_a_probe_is_judged_against_the_kept_level_on_both_sides_of_it():
    # The text gets easier round by round (a stretch that repeats itself): every level is
    # equally fast at any moment, so the probe, later than the kept level's average from
    # before it, must not win on that alone.
    sizing = Sizing(max_budget=16)
    while sizing.probe is None:
        sizing.observe(sizing.budget, 60.0, tokens=4)
    probed = sizing.budget
    assert probed == 12
    while sizing.probe is not None:
        sizing.observe(probed, 50.0, tokens=4)
    while sizing.trial is not None:
        sizing.observe(16, 40.0, tokens=4)
    assert sizing.levels[sizing.current] == 16
    # A level that is faster at the same moment is adopted.
    while sizing.probe is None:
        sizing.observe(sizing.budget, 40.0, tokens=4)
    probed = sizing.budget
    while sizing.probe is not None:
        sizing.observe(probed, 30.0, tokens=4)
    while sizing.trial is not None:
        sizing.observe(16, 40.0, tokens=4)
    assert sizing.levels[sizing.current] == probed


def _run_noisy(sizing: Sizing, round_ms, rounds: int, seed: int) -> list[int]:
    """Rounds as the text makes them: about the same time each (one verification), 1 to 5
    tokens (K = 4) as the draft's guesses hold or not."""
    rng = random.Random(seed)
    chosen = []
    for _ in range(rounds):
        budget = sizing.budget
        sizing.observe(budget, round_ms(budget) * rng.uniform(0.9, 1.1), rng.randint(1, 5))
        chosen.append(sizing.levels[sizing.current])
    return chosen


def test_budget_stays_put_when_levels_differ_only_by_chance():
    # Every level equally fast: the text's swings alone must not walk the budget away, and
    # never to 0 (no cache at all).
    runs = [_run_noisy(Sizing(max_budget=16), lambda b: 12.0, 1500, seed) for seed in range(10)]
    assert all(0 not in chosen for chosen in runs)
    assert sum(chosen.count(16) for chosen in runs) > 0.9 * 1500 * len(runs)


def test_budget_moves_to_a_clearly_faster_level_through_the_noise():
    # Budget 0 takes 40% less time per round (a machine where any tree slows the target).
    runs = [_run_noisy(Sizing(max_budget=16), lambda b: 7.2 if b == 0 else 12.0, 1500, seed) for seed in range(10)]
    assert sum(chosen[-1] == 0 for chosen in runs) >= 8


def _run_timed(sizing: Sizing, cost, build_ms, verify_ms: float, rounds: int) -> list[int]:
    """Like _run, with each nonzero level's build time reported as the loop reports it."""
    chosen = []
    for _ in range(rounds):
        budget = sizing.budget
        if budget > 0:
            sizing.observe_build(budget, build_ms(budget), verify_ms)
        sizing.observe(budget, cost(budget), tokens=4)
        chosen.append(sizing.levels[sizing.current])
    return chosen


def test_budget_never_settles_on_a_build_longer_than_the_verification():
    # Throughput alone would pick B = 16, but a 16-branch (or 12-branch) build outlasts the
    # 20 ms verification: the cache would come late, so those levels are left and not retried.
    sizing = Sizing(max_budget=16)
    chosen = _run_timed(sizing, lambda b: 60.0 - b, lambda b: 5.0 + 1.5 * b, 20.0, 100)
    assert chosen[-1] == 8
    assert max(chosen[50:]) == 8
    assert sizing.fits(sizing.levels.index(8)) and not sizing.fits(sizing.levels.index(12))
    # Once that is old news a larger tree may be probed again; it still does not stay.
    chosen = _run_timed(sizing, lambda b: 60.0 - b, lambda b: 5.0 + 1.5 * b, 20.0, 300)
    assert max(chosen) == 8


def test_a_build_too_slow_once_is_retried_later():
    # A slow spell marks B = 16 as outlasting the verification; once that is old news (the
    # machine is fast again, the smaller tree's builds say so) B = 16 may be probed again.
    sizing = Sizing(max_budget=16)
    sizing.observe_build(16, 30.0, 20.0)
    assert not sizing.fits(sizing.levels.index(16)) and sizing.levels[sizing.current] == 12
    for _ in range(256):
        sizing.observe_build(12, 8.0, 20.0)
    assert not sizing.fits(sizing.levels.index(16))
    sizing.observe_build(12, 8.0, 20.0)
    assert sizing.fits(sizing.levels.index(16))


def test_probes_thin_out_once_the_budget_has_settled():
    # B = 8 is clearly best: after the search, probes away from it get rarer (each costs rounds).
    sizing = Sizing(max_budget=16)
    budgets = []
    for _ in range(1200):
        budget = sizing.budget
        sizing.observe(budget, 40.0 + abs(budget - 8) * 3.0, tokens=4)
        budgets.append(budget)
    assert sizing.levels[sizing.current] == 8
    assert sum(b != 8 for b in budgets[-600:]) < 600 * 0.1


def test_a_round_after_a_budget_change_does_not_measure_either_budget():
    # Its time belongs to its own budget, its tokens to the previous round's cache.
    sizing = Sizing(max_budget=8)
    measured = []
    sizing.observe = lambda budget, round_ms, tokens: measured.append((budget, round_ms, tokens))
    tuning = Tuning(max_k=4, max_budget=8, adaptive=True, sizing=sizing)
    tuning.observe_time(8, 30.0, 5)  # a request's first round: drafted by Propose
    assert measured == []
    tuning.observe_time(8, 30.0, 5)
    tuning.observe_time(0, 20.0, 5)  # drafted from the budget-8 cache: measures neither
    tuning.observe_time(0, 20.0, 1)
    assert measured == [(8, 30.0, 5), (0, 20.0, 1)]


def test_k_shrinks_to_the_depth_whose_build_fits_in_a_verification():
    sizing = Sizing(max_budget=8)
    tuning = Tuning(max_k=8, max_budget=8, adaptive=True, sizing=sizing)
    for _ in range(30):
        tuning.observe_round(8, 8)  # everything accepted: acceptance alone asks for K = 8
    assert tuning.k == 8
    # Builds of 9 forwards at 5 ms each beside a 30 ms verification: 6 forwards fit, K = 5.
    for _ in range(40):
        tuning.observe_build(8, 45.0, 30.0, forwards=9)
    assert sizing.max_depth() == 5 and tuning.k == 5
    # Without a tree (budget 0) the build does not bound K.
    sizing.current = 0
    assert tuning.budget == 0 and tuning.k == 8


def test_from_zero_the_next_probe_is_the_last_good_budget():
    # A small tree hits too rarely to pay (B = 1 loses to no tree at all), a larger one pays:
    # from budget 0 a neighbour search would never see that, and left the loop at 0 for the
    # 100+ rounds until its third probe.
    sizing = Sizing(max_budget=16)
    _run(sizing, lambda b: 50.0 if b == 0 else 65.0, 300)
    assert sizing.levels[sizing.current] == 0
    chosen = _run(sizing, lambda b: {0: 50.0, 1: 55.0, 2: 54.0}.get(b, 40.0), 200)
    assert chosen[-1] > 2 and not {1, 2} & set(chosen)


def test_probes_at_zero_thin_out_while_zero_keeps_losing():
    # Every probe at 0 costs a round with no cache (and the lookup after it): once 0 has lost
    # a few times it is tried less and less often, while neighbour probes go on.
    sizing = Sizing(max_budget=16)
    budgets = []
    for _ in range(3000):
        budget = sizing.budget
        sizing.observe(budget, 80.0 if budget == 0 else 40.0 + abs(budget - 8) * 3.0, tokens=4)
        budgets.append(budget)
    assert sizing.levels[sizing.current] == 8
    assert 0 in budgets[:1000]  # still probed while the search is young
    assert sum(b == 0 for b in budgets[1000:]) < 32  # under two 16-round probes; five when every third probe was at 0
    assert sum(b not in (0, 8) for b in budgets[1000:]) > 0  # neighbours still probed


def test_a_request_starts_from_the_coordinators_recent_acceptance():
    # A request's first rounds are sized before it has verified anything: with the pair
    # accepting nearly everything, their fan-out must already favour k = K, and K be the most.
    sizing = Sizing(max_budget=8)
    fresh = Tuning(max_k=8, max_budget=8, adaptive=True, sizing=sizing)
    assert fresh.acceptance == 0.7 and fresh.k == 7
    for _ in range(3):
        earlier = Tuning(max_k=8, max_budget=8, adaptive=True, sizing=sizing)
        for _ in range(16):
            earlier.observe_round(8, 8)
    informed = Tuning(max_k=8, max_budget=8, adaptive=True, sizing=sizing)
    assert informed.acceptance > 0.95 and informed.k == 8
    assert informed.fanout(8, 4096, 0.5)[8] == max(informed.fanout(8, 4096, 0.5))
    # A prior, not a verdict: the request's own rounds take over.
    for _ in range(10):
        informed.observe_round(8, 0)
    assert informed.acceptance < 0.3
