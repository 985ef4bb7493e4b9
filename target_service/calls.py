"""What the target's runner is asked: a verify or a prefill of one session, checked."""

from __future__ import annotations

import dataclasses

from specd.core.sampling import SamplingSettings, SparseDist


@dataclasses.dataclass(frozen=True)
class VerifyCall:
    """One checked verify: d_1..d_K after the committed tail, in the runner's terms."""

    session_id: str
    start: int
    tokens: list[int]  # the committed tail, from position `start`
    draft_tokens: list[int]
    dists: list[SparseDist]  # q of each draft token; empty when greedy
    sampling: SamplingSettings
    return_logprobs: bool
    reserve_tokens: int = 0  # KV room a session this call opens reserves (CommittedTokens.reserve_tokens)

    @property
    def num_draft(self) -> int:
        return len(self.draft_tokens)


@dataclasses.dataclass(frozen=True)
class PrefillCall:
    """Cache a session's committed tokens but the last (the next verify feeds it)."""

    session_id: str
    start: int
    tokens: list[int]  # the committed tail, from position `start`
    reserve_tokens: int = 0  # KV room a session this call opens reserves (CommittedTokens.reserve_tokens)


Call = VerifyCall | PrefillCall
Prefilled = tuple[int, float]  # (tokens cached, forward ms)
