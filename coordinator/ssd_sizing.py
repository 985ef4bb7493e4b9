"""One ssd request's K, budget B and running acceptance: what sizes its speculation trees.

K and B are the request's (its num_speculative_tokens, the coordinator's --ssd-budget), cut only
when many requests run at once (coordinator/load.py): an adaptive controller that moved them from
measured throughput did not beat a fixed budget on the default pair (docs/ssd.md, "Budget: fixed"). The acceptance is the request's own,
never shared with other requests: the fan-out spreads the budget over the outcomes (k, t*) it
makes likely (specd/fanout.py), and the early Speculate bets on the likeliest of them.
"""

from __future__ import annotations

import dataclasses

from coordinator.acceptance import AcceptanceEstimate
from coordinator.load import UNLIMITED, SpeculationLoad
from specd import fanout as fanout_lib

# Acceptance (per token) before the request has verified anything, and its weight in rounds.
_PRIOR_ACCEPTANCE, _PRIOR_WEIGHT = 0.7, 2.0
_DECAY = 0.9  # per round: recent rounds dominate the estimate


@dataclasses.dataclass
class RequestSizing:
    """A request's fixed K and budget, and its per-token acceptance (coordinator/acceptance.py)."""

    asked_k: int
    asked_budget: int
    load: SpeculationLoad = UNLIMITED
    estimate: AcceptanceEstimate = dataclasses.field(
        default_factory=lambda: AcceptanceEstimate(_PRIOR_ACCEPTANCE, _PRIOR_WEIGHT, _DECAY)
    )

    @property
    def k(self) -> int:
        """Draft tokens per round now: K, less under load."""
        return self.load.k(self.asked_k)

    @property
    def budget(self) -> int:
        """Branches per tree now: B, less under load."""
        return self.load.budget(self.asked_budget)

    @property
    def acceptance(self) -> float:
        return self.estimate.value

    def observe_round(self, num_draft: int, accepted: int) -> None:
        self.estimate.observe(num_draft, accepted)

    def fanout(self, num_draft: int, vocab_size: int, r: float) -> list[int]:
        """F_0..F_K: guesses per outcome k of verifying `num_draft` tokens, under the budget."""
        return fanout_lib.allocate(self.acceptance, num_draft, self.budget, vocab_size, r)
