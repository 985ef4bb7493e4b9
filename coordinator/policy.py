"""Whether and how much a request speculates, decided once per round by one object per request.

A round's plan (RoundPlan) comes from three inputs:
- the load: requests in their rounds now. Past the profile's `speculation_max_running` each
  round drafts half its K and tree budget, past twice that none: a busy target batches every
  request's steps into each forward, where extra draft tokens lengthen everyone's forward
  (its rounds then cost what `off` costs, and say `under_load`);
- the request's acceptance (one estimate, one prior: the profile's): how the ssd tree's branches
  spread over the outcomes, and, for a greedy sd request under load, the K that pays by the
  coordinator's measured round costs;
- for `auto`, whether speculation has measured faster than target-only decoding for this
  request (GainComparison): while it has not, its rounds decode target-only (`no_gain`).
A request that names its mode gets it in every round, the load aside; a sampled sd request keeps
its K at any load, since which positions it drafts is part of what its seed reproduces.
Greedy output does not depend on any of this (the exactness contract): it changes speed only.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable

from coordinator.policy_measures import AcceptanceEstimate, GainComparison, RoundCosts, k_that_pays
from coordinator.profiles import SpeculationProfile
from specd.core import fanout
from specd.core.sampling import SamplingSettings
from specd.wire.modes import OFF, SD

# Why a speculating request's round drafts nothing (a round span's specd.round.target_only).
UNDER_LOAD = "under_load"  # too many requests run at once
NO_GAIN = "no_gain"  # an `auto` request measured target-only decoding faster for itself


@dataclasses.dataclass(frozen=True)
class RoundPlan:
    """What a round does, and what decided it (both on the round's span)."""

    num_draft: int  # K: draft tokens this round (0: a target-only step)
    budget: int  # ssd: most branches of the tree built beside the verify
    backup: str  # ssd: the draft of a round whose cache lookup missed (ngram or jit)
    target_only: str  # why a speculating request's round drafts nothing: UNDER_LOAD, NO_GAIN or ""
    running: int  # requests in their rounds now
    acceptance: float  # the request's per-token acceptance estimate


def load_share(running: int, max_running: int) -> float:
    """1: speculate as asked; 0.5: half the draft tokens and tree budget; 0: none."""
    if max_running <= 0 or running <= max_running:
        return 1.0
    return 0.5 if running <= 2 * max_running else 0.0


def scaled(asked: int, share: float) -> int:
    if share >= 1.0 or asked <= 0:
        return asked
    return max(1, int(asked * share)) if share > 0 else 0


class SpeculationPolicy:
    """One request's speculation, round by round (see the module's docstring)."""

    def __init__(
        self,
        mode: str,
        asked_k: int,
        sampling: SamplingSettings,
        profile: SpeculationProfile,
        running: Callable[[], int] = lambda: 1,
        costs: RoundCosts | None = None,
        auto: bool = False,
    ):
        self.mode = mode  # ssd, sd or off: what the request runs (auto resolved)
        self.asked_k = asked_k
        self.profile = profile
        self.running = running
        self.acceptance = AcceptanceEstimate(profile.acceptance_prior, profile.acceptance_prior_weight, profile.acceptance_decay)
        # A seeded sampled sd request keeps its K at any load (its seed reproduces its output only with it).
        self._follows_load = not (mode == SD and not sampling.greedy)
        # Greedy sd under load drafts the K that pays; not where the load policy is off.
        self._costs = costs if mode == SD and sampling.greedy and profile.speculation_max_running > 0 else None
        self.gain = GainComparison(profile.few_tokens) if auto and mode != OFF else None
        self._last_round_end = time.perf_counter()

    def _share(self, running: int) -> float:
        """The share of K and budget this round may use: none while auto measures target-only
        faster, else as the load allows (all of it where the request does not follow the load)."""
        if self.gain is not None and not self.gain.speculates:
            return 0.0
        return load_share(running, self.profile.speculation_max_running) if self._follows_load else 1.0

    @property
    def k(self) -> int:
        """Draft tokens per round now: K, less under load, none while auto measures target-only faster."""
        return scaled(self.asked_k, self._share(self.running()))

    @property
    def backup(self) -> str:
        """ssd: the draft of a round whose cache lookup missed: ngram (prompt lookup) or jit (a Propose)."""
        return self.profile.ssd_backup

    @property
    def budget(self) -> int:
        """ssd: branches per tree now: the profile's budget, less under load."""
        return scaled(self.profile.ssd_budget, self._share(self.running()))

    def target_only(self, running: int) -> str:
        """Why a round of a speculating request drafts nothing now ("" if it drafts)."""
        if self._follows_load and load_share(running, self.profile.speculation_max_running) <= 0.0:
            return UNDER_LOAD
        return NO_GAIN if self.gain is not None and not self.gain.speculates else ""

    def plan(self) -> RoundPlan:
        """The next round's plan."""
        running = self.running()
        share = self._share(running)
        k = scaled(self.asked_k, share)
        if self._costs is not None and k > 0 and running > 1:
            k = k_that_pays(k, self.acceptance.value, self._costs)
        target_only = self.target_only(running) if self.mode != OFF and self.asked_k > 0 and k <= 0 else ""
        return RoundPlan(
            num_draft=k if self.mode != OFF else 0,
            budget=scaled(self.profile.ssd_budget, share),
            backup=self.backup,
            target_only=target_only,
            running=running,
            acceptance=self.acceptance.value,
        )

    def fanout(self, num_draft: int, vocab_size: int) -> list[int]:
        """F_0..F_K: the tree's guesses per outcome k of verifying `num_draft` tokens, under the budget."""
        return fanout.allocate(self.acceptance.value, num_draft, self.budget, vocab_size, self.profile.ssd_fanout_r)

    def verified(self, num_draft: int, accepted: int, costs_ms: tuple[float, float] | None = None) -> None:
        """A verify answered: its draft tokens and how many were accepted, and (sd) what the round
        cost: the draft wait and the verify's wall time (None: not a cost of drafting, round 0's)."""
        self.acceptance.observe(num_draft, accepted)
        if self._costs is not None and costs_ms is not None:
            self._costs.observe(num_draft, *costs_ms)

    def round_done(self, num_draft: int, tokens: int) -> None:
        """A round's tokens were committed: auto's comparison counts it by the wall time since the
        round before ended (rounds overlap in ssd: the time between their ends is the request's pace)."""
        now = time.perf_counter()
        if self.gain is not None:
            self.gain.observe(num_draft > 0, tokens, (now - self._last_round_end) * 1000.0)
        self._last_round_end = now
