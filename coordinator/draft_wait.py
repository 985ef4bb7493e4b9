"""How long a round waits for the draft worker before it takes its backup.

A draft that hangs (a stopped process, a stalled node) answers nothing and fails no call: only
the worker timeout would end the wait, and every round would stall for it. So a round waits for
the draft at most `draft_wait_verifies` times the request's latest worker call (the measured
wall time of its latest target call, the prefill's before the first verify, or of its latest
draft call if that took longer: a draft queueing many requests' work is busy, not hung), and
never less than `draft_wait_min_ms`. Past that the round goes on without the draft's answer
(sd: target-only; ssd: its backup), the call is cancelled, and the draft is down until it
answers its health check (DraftLink).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Awaitable, TypeVar

from coordinator.draft_link import DraftFailed, DraftLink

T = TypeVar("T")


@dataclasses.dataclass(frozen=True)
class DraftWait:
    verifies: float = 4.0  # as CoordinatorConfig.draft_wait_verifies
    min_ms: float = 1000.0  # as CoordinatorConfig.draft_wait_min_ms

    def seconds(self, *call_ms: float | None) -> float:
        """The bound, given the wall times of the request's latest worker calls (None: none yet)."""
        scaled_ms = self.verifies * max((ms for ms in call_ms if ms is not None), default=0.0)
        return max(self.min_ms, scaled_ms) / 1000.0


async def answer_within(draft: DraftLink, call: Awaitable[T], wait_s: float) -> T:
    """The draft's answer to `call` if it comes within `wait_s`; else the call is cancelled,
    the draft marked down, and DraftFailed raised (the round takes its backup).

    Not asyncio.wait_for: on Python 3.11 it returns the answer when the caller is cancelled in
    the loop turn the answer comes, and drops the cancellation, so a request whose caller went
    away decoded on to its end (its sessions held all the while). asyncio.timeout keeps it."""
    try:
        async with asyncio.timeout(wait_s):
            return await call
    except TimeoutError:
        raise DraftFailed(draft.timed_out(wait_s)) from None
