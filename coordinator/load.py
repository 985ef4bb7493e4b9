"""Speculation under load: each request drafts less, then nothing, as more requests run.

Speculation spends compute on tokens the target may reject, to save target forwards one
request would otherwise run one after another. Once the target batches many requests' steps
into each forward (specd/batcher.py), a forward is no longer one request's: extra draft tokens
make every forward of the batch longer, and the draft and the coordinator's extra calls take
cores from the rest. So past `max_running` requests at once, each round of a request drafts
half its K (and an ssd tree half its budget); past twice that, none: its rounds are plain
target steps, batched with everyone else's, and cost what `off` costs. The draft's session
is not touched while a request drafts nothing: the next Propose or Speculate carries the
committed tokens it missed, and the draft catches up in that one call.

The limit comes from `specd bench --concurrency` on the default pair (docs/batching.md); 0
turns the policy off (every request speculates as asked at any load). The decision is each
request's own, taken every round from the number of requests running then.
"""

from __future__ import annotations

import dataclasses
from typing import Callable


# Why a speculating request's round went target-only (a round span's specd.round.target_only).
UNDER_LOAD = "under_load"  # too many requests run at once (this module)
NO_GAIN = "no_gain"  # an `auto` request measured target-only decoding faster for itself (speculation_gain.py)


@dataclasses.dataclass(frozen=True)
class SpeculationLoad:
    max_running: int  # --speculation-max-running; 0: no limit
    running: Callable[[], int] = lambda: 1  # requests running now, this one included

    def share(self) -> float:
        """1: speculate as asked; 0.5: half the draft tokens and tree budget; 0: none."""
        running = self.running()
        if self.max_running <= 0 or running <= self.max_running:
            return 1.0
        return 0.5 if running <= 2 * self.max_running else 0.0

    def k(self, asked: int) -> int:
        """Draft tokens per round for a request that asked for `asked`."""
        return _scaled(asked, self.share())

    def budget(self, asked: int) -> int:
        """ssd: branches per speculation tree under a configured budget of `asked`."""
        return _scaled(asked, self.share())

    def target_only(self) -> str:
        """Why a round of a speculating request drafts nothing now: UNDER_LOAD, or "" if it drafts."""
        return UNDER_LOAD if self.share() <= 0.0 else ""


def _scaled(asked: int, share: float) -> int:
    if share >= 1.0 or asked <= 0:
        return asked
    return max(1, int(asked * share)) if share > 0 else 0


UNLIMITED = SpeculationLoad(0)
