"""What one round yields: its tokens and how they came, for the request's stats, spans and policy."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class RoundResult:
    index: int
    mode: str  # what this round ran: ssd (it drafted, or the draft speculated beside it), sd or off
    tokens: list[int]  # d_1..d_k, then t*
    logprobs: list[float]
    num_draft: int  # K of this round (0: a plain decode step)
    accepted: int  # k
    bonus: bool  # t* is a bonus token (else recovered)
    draft_wait_ms: float  # time the loop waited on the draft worker
    verify_ms: float  # the target's forward
    fallback_reason: str  # why this round did not speculate as asked, if it did not
    # ssd only: whether this round's draft came from the speculation cache (None: no lookup),
    # the backup that drafted it on a miss, and the branches built during its verification.
    hit: bool | None = None
    miss: str = ""  # why a lookup missed: uncovered, late, failed or no_speculation (see ssd_speculator)
    backup: str = ""
    branches: int = 0
    speculate_ms: float = 0.0  # the draft worker's forwards for those branches
    verified_ahead: bool = False  # the target verified it right after the previous round (VerifyAfter)
    speculated_early: bool = False  # ssd: its tree was started before the previous round's verify answered
    target_only: str = ""  # why a speculating request's round drafted nothing: policy.UNDER_LOAD or policy.NO_GAIN
