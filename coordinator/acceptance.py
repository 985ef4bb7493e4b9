"""A request's per-token acceptance, from its rounds: what its speculation sizes itself by.

The capped-geometric maximum-likelihood estimate from decayed counts: accepted tokens over
accepted tokens plus rejections (a round that accepts all its draft tokens rejects none).
Decayed per round, so that recent rounds dominate; a prior stands in before the first round.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class AcceptanceEstimate:
    prior: float  # per-token acceptance before any round
    prior_weight: float  # the prior's weight, in rounds
    decay: float  # per round
    accepted: float = dataclasses.field(init=False)  # decayed sum of accepted tokens
    rejected: float = dataclasses.field(init=False)  # decayed count of rejections

    def __post_init__(self) -> None:
        self.accepted = self.prior * self.prior_weight
        self.rejected = (1 - self.prior) * self.prior_weight

    @property
    def value(self) -> float:
        """Per drafted token, given the ones before it were accepted."""
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_draft: int, accepted: int) -> None:
        """A round that drafted `num_draft` tokens and kept `accepted` (none drafted: nothing learnt)."""
        if num_draft == 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1.0 if accepted < num_draft else 0.0)
