"""One request's state, owned by the coordinator: its committed tokens, what each worker was sent
of them, and what its rounds share (its policy, its spans, the draft wait). The sd and ssd loops
(coordinator/sd_rounds.py, coordinator/ssd_rounds.py) both run on it.

The loop yields one RoundResult per target forward; coordinator/rounds_ahead.py commits its
tokens (up to an EOS) to `committed` before the loop goes on, so a loop always drafts after
exactly what was committed; their text settles behind, and a stop string found there cuts
`committed` back when the request ends.
"""

from __future__ import annotations

import asyncio
import dataclasses

from coordinator.draft_wait import DraftWait
from coordinator.policy import SpeculationPolicy
from coordinator.round_trace import RoundTrace
from coordinator.workers import WorkerSession
from specd.core.sampling import SamplingSettings
from specd.wire.modes import OFF, SSD


@dataclasses.dataclass
class RequestState:
    session_id: str
    committed: list[int]  # prompt + generated so far
    sampling: SamplingSettings
    policy: SpeculationPolicy  # each round's K, tree budget and backup; its mode (auto resolved)
    max_support: int
    return_logprobs: bool
    max_len: int  # committed may grow to this many tokens
    eos_token_ids: frozenset[int] = frozenset()  # tokens that end the request (none with ignore_eos)
    trace: RoundTrace = dataclasses.field(default_factory=RoundTrace)  # the request's round spans
    draft_wait: DraftWait = dataclasses.field(default_factory=DraftWait)  # how long a round waits for the draft
    target_prefill: asyncio.Future | None = None  # the prompt's prefill, until round 0 awaits it
    target_session: WorkerSession = dataclasses.field(init=False)  # what the target was sent of `committed`
    draft_session: WorkerSession = dataclasses.field(init=False)  # what the draft was sent of it

    def __post_init__(self) -> None:
        # The target caches at most the longest committed history and a verify's drafts past it,
        # a verify ahead's too; the draft also writes its speculation tree's branches.
        k = self.policy.asked_k if self.mode != OFF else 0
        target_tokens = self.max_len + 2 * (k + 1)
        tree_tokens = self.policy.profile.ssd_budget * (k + 1) if self.mode == SSD else 0
        self.target_session = WorkerSession(self.session_id, reserve_tokens=target_tokens)
        self.draft_session = WorkerSession(self.session_id, reserve_tokens=target_tokens + tree_tokens)

    @property
    def mode(self) -> str:
        """ssd, sd or off: the mode the request runs (auto resolved before)."""
        return self.policy.mode

    @property
    def remaining(self) -> int:
        """Tokens the request may still generate."""
        return self.max_len - len(self.committed)

    def draft_wait_s(self) -> float:
        """How long this round may wait for the draft: scaled by the latest worker calls' times."""
        return self.draft_wait.seconds(self.target_session.call_ms, self.draft_session.call_ms)

    def drop_target_prefill(self) -> None:
        """Cancel a prefill nobody will await (the request ended first), retrieving any error."""
        prefill, self.target_prefill = self.target_prefill, None
        if prefill is None:
            return
        if prefill.done():
            if not prefill.cancelled():
                prefill.exception()
        else:
            prefill.cancel()

    async def target_prefilled(self) -> None:
        """Wait for the target's prefill, if one is under way; raises what it raised."""
        if self.target_prefill is not None:
            prefill, self.target_prefill = self.target_prefill, None
            await prefill
