"""Per-request speculation statistics, counted the standard way.

rounds = the target's verify forwards (in ssd the first is also the prompt's prefill);
acceptance_rate = accepted / draft tokens;
mean acceptance length = 1 + accepted / rounds.
"""

from __future__ import annotations

import dataclasses

from coordinator.round_result import RoundResult
from specd.v1 import coordinator_pb2
from specd.wire.modes import OFF, mode_value


@dataclasses.dataclass
class RequestStats:
    requested_mode: str
    seed: int
    rounds: int = 0
    speculative_rounds: int = 0  # rounds that verified a draft
    ran_speculation: bool = False  # a round drafted, or (ssd) had the draft speculating beside it
    draft_tokens: int = 0
    accepted_tokens: int = 0
    accepted_per_position: list[int] = dataclasses.field(default_factory=list)
    cache_hits: int = 0
    cache_misses: int = 0
    draft_wait_ms: float = 0.0
    verify_ms: float = 0.0
    verified_ahead: int = 0
    speculated_early: int = 0
    fallback_reason: str = ""
    queue_ms: float = 0.0  # time the request waited for a place (coordinator/admission.py)

    def add(self, result: RoundResult) -> None:
        self.rounds += 1
        self.draft_tokens += result.num_draft
        self.accepted_tokens += result.accepted
        self.draft_wait_ms += result.draft_wait_ms
        self.verify_ms += result.verify_ms
        self.verified_ahead += result.verified_ahead
        self.speculated_early += result.speculated_early
        if result.num_draft:
            self.speculative_rounds += 1
        if result.mode != OFF:
            self.ran_speculation = True
        if len(self.accepted_per_position) < result.accepted:
            self.accepted_per_position.extend([0] * (result.accepted - len(self.accepted_per_position)))
        for position in range(result.accepted):
            self.accepted_per_position[position] += 1
        if result.hit is not None:
            if result.hit:
                self.cache_hits += 1
            else:
                self.cache_misses += 1
        if result.fallback_reason and not self.fallback_reason:
            self.fallback_reason = result.fallback_reason

    @property
    def mode(self) -> str:
        """The mode that ran: the one asked for if any round speculated, else target-only."""
        return self.requested_mode if self.ran_speculation else OFF

    @property
    def acceptance_rate(self) -> float:
        """Accepted / proposed draft tokens; 0 when none were proposed."""
        return self.accepted_tokens / self.draft_tokens if self.draft_tokens else 0.0

    def to_proto(self) -> coordinator_pb2.SpeculationStats:
        lookups = self.cache_hits + self.cache_misses
        return coordinator_pb2.SpeculationStats(
            mode=mode_value(self.mode),
            rounds=self.rounds,
            draft_tokens=self.draft_tokens,
            accepted_tokens=self.accepted_tokens,
            acceptance_rate=self.acceptance_rate,
            mean_acceptance_length=1.0 + self.accepted_tokens / self.rounds if self.rounds else 0.0,
            fallback_reason=self.fallback_reason,
            accepted_per_position=self.accepted_per_position,
            cache_hits=self.cache_hits,
            cache_misses=self.cache_misses,
            cache_hit_rate=self.cache_hits / lookups if lookups else 0.0,
            draft_wait_ms=self.draft_wait_ms,
            verify_ms=self.verify_ms,
            verified_ahead=self.verified_ahead,
            speculated_early=self.speculated_early,
            seed=self.seed,
            queue_ms=self.queue_ms,
        )
