"""An ssd round whose shared draft link goes down while the round awaits its backup draft.

The coordinator's DraftLink is shared by every request: another request's failed draft call
marks it down (`info` = None) at any await. A round that drafted its backup before that must
still verify it, and start no Speculate beside the verify (there is no draft to ask), instead
of failing the request: a lost draft costs speed, never the request (DESIGN, "Ownership of state").
"""

from __future__ import annotations

import asyncio

from coordinator.config import CoordinatorConfig
from coordinator.ssd_rounds import Lookup, SsdRequest
from coordinator.ssd_speculator import MISS_FAILED
from specd.v1 import draft_pb2, target_pb2
from tests.request_states import request_state

DRAFTED = [5, 6, 7]


class DraftLinkLostDuringPropose:
    """A draft link that another request marks down while this request's Propose is in flight."""

    def __init__(self):
        self.info = draft_pb2.DraftInfo(vocab_size=100, context_length=0)
        self.last_error = ""
        self.speculations = 0

    def usable(self) -> bool:
        return self.info is not None

    def room(self, committed: int) -> int:
        return 1 << 30

    async def propose(self, session, committed, num_tokens, sampling, max_support, saguaro=None):
        await asyncio.sleep(0)
        self.info, self.last_error = None, "another request's draft call failed"  # DraftLink.mark_down
        return draft_pb2.ProposeResponse(draft_tokens=DRAFTED[:num_tokens])

    async def speculate(self, *args, **kwargs):
        self.speculations += 1


class TargetRejectingAll:
    async def verify(self, session, committed, tokens, dists, sampling, return_logprobs, deadline=None):
        return target_pb2.VerifyResponse(accepted=0, next_token=9)


def test_a_round_whose_draft_went_down_during_its_backup_verifies_it_without_a_speculate():
    async def first_drafting_round():
        state = request_state([1, 2, 3, 4], k=len(DRAFTED), max_len=40, ssd_backup="jit")
        draft = DraftLinkLostDuringPropose()
        ssd = SsdRequest(state, TargetRejectingAll(), draft, CoordinatorConfig())
        try:
            speculated = await ssd.speculate(1, state.policy.plan())  # round 1, nothing speculated for it: the jit backup
            verified = await speculated.verify
        finally:
            ssd.close()
        return speculated, verified, draft

    speculated, verified, draft = asyncio.run(first_drafting_round())
    assert speculated.drafted.draft.tokens == DRAFTED and speculated.drafted.source == "jit"
    assert speculated.speculation is None and draft.speculations == 0
    assert verified.next_token == 9


def test_the_round_after_a_failed_speculate_counts_its_lookup_as_a_miss():
    """The Speculate beside the last verify failed and marked the draft down: the next round
    decodes target-only, and its lookup is a miss, `failed` (stats' cache_misses, the span's reason)."""

    async def round_after_the_failure():
        state = request_state([1, 2, 3, 4], k=len(DRAFTED), max_len=40)
        draft = DraftLinkLostDuringPropose()
        draft.info, draft.last_error = None, "the draft's Speculate failed"
        ssd = SsdRequest(state, TargetRejectingAll(), draft, CoordinatorConfig())
        try:
            lookup = Lookup(len(state.committed), None, MISS_FAILED, "the draft's Speculate failed")
            return await ssd._draft_round(2, lookup, state.policy.plan())
        finally:
            ssd.close()

    drafted = asyncio.run(round_after_the_failure())
    assert drafted.draft.tokens == [] and not drafted.speculates
    assert drafted.hit is False and drafted.miss == MISS_FAILED and drafted.fallback
