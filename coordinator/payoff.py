"""Whether speculation pays: a greedy sd request's K, chosen each round from what rounds cost.

An sd round of K draft tokens costs K draft forwards and a verify of K + 1 tokens, and yields
(1 - a^(K+1)) / (1 - a) tokens on average when each drafted token is accepted with probability a.
A plain round (K = 0) costs one target step and yields one token. Which K gives the most tokens
per second depends on the request's acceptance (its own text) and on what forwards cost now
(the machine, and how many requests share each batched forward): on two CPU cores with the
default pair, K = 4 alone is slower than plain steps, while K = 1 or 2 is faster.

So once more than one request runs, each round of a greedy sd request takes the K in
1..(what the load allows, coordinator/load.py) that maximises expected tokens per millisecond.
It drafts at least one token while the load allows any: turning speculation off is the load
policy's call, and a request that drafts keeps measuring its acceptance.
The costs are the coordinator's own measurements, shared by all requests (`RoundCosts`): the
draft's wall time per drafted token, and the verify's wall time by the number of tokens it
verified. The acceptance is the request's own, decayed so that recent rounds dominate.

Greedy output does not depend on K (the exactness contract), so this changes speed only. A
request alone keeps the K it asked for; sampled sd requests keep theirs at any load (their seed
reproduces their output only with the same K: coordinator/servicer.py).
"""

from __future__ import annotations

import dataclasses

from coordinator.acceptance import AcceptanceEstimate
from coordinator.load import SpeculationLoad

# A request's acceptance before it has verified anything, and its weight in rounds.
_PRIOR_ACCEPTANCE, _PRIOR_WEIGHT = 0.6, 2.0
_DECAY = 0.85  # per round: recent rounds dominate
_COST_DECAY = 0.9  # per observation of a cost: the load changes, so do forwards' costs
# A verify's extra cost per extra token, as a fraction of a one-token verify, until two token
# counts have been measured (the default target on CPU: 5 tokens cost ~1.5x one).
_PRIOR_TOKEN_SLOPE = 0.125


class _Average:
    """An exponentially decayed mean."""

    def __init__(self, decay: float):
        self.decay = decay
        self.total = 0.0
        self.weight = 0.0

    def add(self, value: float) -> None:
        self.total = self.total * self.decay + value
        self.weight = self.weight * self.decay + 1.0

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


class RoundCosts:
    """What sd rounds cost, as the coordinator measured them: shared by every request."""

    def __init__(self) -> None:
        self._draft_ms_per_token = _Average(_COST_DECAY)
        self._verify_ms: dict[int, _Average] = {}  # tokens verified (K + 1) -> wall ms

    def observe(self, num_draft: int, draft_ms: float, verify_ms: float) -> None:
        """One round: its K, the time it waited on the draft, the verify call's wall time."""
        if num_draft > 0 and draft_ms > 0:
            self._draft_ms_per_token.add(draft_ms / num_draft)
        self._verify_ms.setdefault(num_draft + 1, _Average(_COST_DECAY)).add(verify_ms)

    def draft_ms(self, num_draft: int) -> float | None:
        per_token = self._draft_ms_per_token.value
        return None if per_token is None else per_token * num_draft

    def verify_ms(self, tokens: int) -> float | None:
        """A verify of `tokens` tokens: a line through the measured token counts (one
        measured count: the prior slope through it); None before any verify."""
        points = sorted((n, avg.value) for n, avg in self._verify_ms.items() if avg.value is not None)
        if not points:
            return None
        if len(points) == 1:
            n, ms = points[0]
            one_token_ms = ms / (1.0 + _PRIOR_TOKEN_SLOPE * (n - 1))
            return one_token_ms * (1.0 + _PRIOR_TOKEN_SLOPE * (tokens - 1))
        (n0, ms0), (n1, ms1) = points[0], points[-1]
        slope = max(0.0, (ms1 - ms0) / (n1 - n0))  # more tokens never verify faster
        return ms0 + slope * (tokens - n0)


def expected_tokens(acceptance: float, num_draft: int) -> float:
    """Tokens a round yields on average: accepted drafts plus the target's own, (1 - a^(K+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return float(num_draft + 1)
    return (1.0 - acceptance ** (num_draft + 1)) / (1.0 - acceptance)


@dataclasses.dataclass
class SpeculationPayoff:
    """One greedy sd request's K per round: the load's cap, then what pays under it."""

    load: SpeculationLoad
    costs: RoundCosts
    acceptance: AcceptanceEstimate = dataclasses.field(
        default_factory=lambda: AcceptanceEstimate(_PRIOR_ACCEPTANCE, _PRIOR_WEIGHT, _DECAY)
    )

    def k(self, asked: int) -> int:
        """Draft tokens for the next round."""
        cap = self.load.k(asked)
        if cap <= 0 or self.load.running() <= 1:
            return cap
        best_k, best_rate = cap, None
        for k in range(1, cap + 1):
            rate = self._tokens_per_ms(k)
            if rate is None:
                return cap  # nothing measured yet: speculate as the load allows
            if best_rate is None or rate > best_rate:
                best_k, best_rate = k, rate
        return best_k

    def _tokens_per_ms(self, num_draft: int) -> float | None:
        verify_ms, draft_ms = self.costs.verify_ms(num_draft + 1), self.costs.draft_ms(num_draft)
        if verify_ms is None or draft_ms is None or verify_ms + draft_ms <= 0:
            return None
        return expected_tokens(self.acceptance.value, num_draft) / (verify_ms + draft_ms)

    def observe_round(self, num_draft: int, accepted: int, costs_ms: tuple[float, float] | None) -> None:
        """A round's outcome, and what it cost (draft wait, verify wall time; None: not measured)."""
        if costs_ms is not None:
            self.costs.observe(num_draft, *costs_ms)
        self.acceptance.observe(num_draft, accepted)
