"""The SSD round loop (Saguaro): verify round T while the draft speculates round T+1.

One round (ssd_round) reads as the paper's step:
- SPECULATE: round T's draft goes to the target (Verify(T)) and Speculate(T) goes to the
  draft beside it (coordinator/ssd_speculator.py). Round T's draft is round T-1's cache hit, a
  hit already on the target (sent ahead), or on a miss the backup's (coordinator/backup.py).
- VERIFY: the loop waits for Verify(T). A cache that arrives first goes on to the target as
  round T+1's verify for each cached outcome (coordinator/verify_ahead.py), and Speculate(T+1)
  starts early for Verify(T)'s likeliest outcome.
- LOOK UP: Verify(T)'s outcome (k, t*) in the cache (coordinator/speculation_cache.py): a hit
  is round T+1's draft, ready with no draft call on the critical path; a miss says why. On a
  hit sent ahead, round T+1 is on the target already: the loop starts the Speculate beside it
  before handing round T's tokens to the caller.
A round's worker calls are children of its own `spec_round` span, whenever they start: work
started for round T+1 during round T (its verifies sent ahead, its Speculate started early or
on a hit sent ahead) opens round T+1's span then (RoundTrace.ahead), and round T+1 runs in it.
Round spans may so overlap in time, as the rounds do.
Every Speculate and Propose carries the committed tail, so the draft's KV cache follows the
committed tokens whichever branch won. A draft failure turns the rounds target-only until the
draft is back, as in sd.

Exactness: any q is exact as long as the verifier gets the q the draft sampled from, and each
cache entry carries its own. Which q a round uses depends on timing, so ssd is
distribution-exact rather than seed-reproducible (docs/api.md, "Exactness").
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

from coordinator.backup import draft_after_miss
from coordinator.config import CoordinatorConfig
from coordinator.draft_link import DraftFailed, DraftLink
from coordinator.policy import RoundPlan
from coordinator.request_state import RequestState
from coordinator.round_result import RoundResult
from coordinator.speculation_cache import Draft, SpeculationCache
from coordinator.ssd_speculator import MISS_FAILED, MISS_NO_SPECULATION, MISS_UNCOVERED, Speculation, Speculator
from coordinator.target_link import TargetLink
from coordinator.verify_ahead import SentAhead, VerifyAhead, cancel_unawaited
from specd.core.outcomes import Outcome, outcome_of
from specd.v1 import target_pb2
from specd.wire.modes import OFF, SSD

_NO_DRAFT = Draft([], [])


@dataclasses.dataclass(frozen=True)
class RoundDraft:
    """Round T's draft and where it came from."""

    draft: Draft
    source: str = ""  # cache, ahead (a hit already sent to the target), jit, ngram; "" for none
    hit: bool | None = None  # found in the cache (None: no lookup)
    miss: str = ""  # why the lookup missed (ssd_speculator.MISS_*)
    backup: str = ""  # the backup asked for on a miss
    fallback: str = ""  # why the round cannot speculate, if it cannot
    wait_ms: float = 0.0  # what the loop waited on the draft to get it
    speculates: bool = True  # the draft is usable: a Speculate may go beside the verify
    target_only: str = ""  # why the request's policy has this round draft nothing (coordinator/policy.py)


@dataclasses.dataclass(frozen=True)
class Speculated:
    """SPECULATE's result: round T as sent - its draft, Verify(T) in flight, the Speculate beside it."""

    drafted: RoundDraft
    verify: asyncio.Future  # -> target_pb2.VerifyResponse
    speculation: Speculation | None
    speculated_early: bool = False  # that Speculate started before round T-1's verify answered


@dataclasses.dataclass(frozen=True)
class Verified:
    """VERIFY's result: Verify(T)'s answer and the tokens round T emits (d_1..d_k, t*)."""

    response: target_pb2.VerifyResponse
    tokens: list[int]

    @property
    def outcome(self) -> Outcome:
        return outcome_of(self.response)


@dataclasses.dataclass(frozen=True)
class Lookup:
    """LOOK UP's result: round T+1's draft from the cache built beside Verify(T), or why none."""

    at: int  # len(committed) round T+1 continues from
    draft: Draft | None  # None: a miss
    miss: str = MISS_NO_SPECULATION
    failure: str = ""  # the draft failed (round T reports it as its fallback)
    wait_ms: float = 0.0  # what the loop waited for the cache
    speculate_ms: float = 0.0  # the draft's forwards for the cache


@dataclasses.dataclass(frozen=True)
class _Launch:
    """Round T+1, started before round T was handed to the caller: a hit whose verify went
    ahead to the target, and the Speculate beside it."""

    at: int  # len(committed) it continues from
    sent: SentAhead
    verify: asyncio.Future  # -> its VerifyResponse, from the call sent ahead
    speculation: Speculation | None
    speculated_early: bool

    def cancel(self) -> None:
        cancel_unawaited(self.verify)
        self.sent.cancel()
        if self.speculation is not None:
            self.speculation.task.cancel()


class SsdRequest:
    """One ssd request's in-flight state: the round already under way (a hit sent ahead), the
    lookup the next round drafts from, its Speculate calls and its verifies sent ahead."""

    def __init__(self, state: RequestState, target: TargetLink, draft: DraftLink | None, config: CoordinatorConfig):
        self.state, self._target, self._draft, self._config = state, target, draft, config
        self._ahead = VerifyAhead(state, target)
        self._speculator = Speculator(state, draft, config)
        self._launch: _Launch | None = None
        self._lookup: Lookup | None = None
        self._beside: Speculation | None = None  # the Speculate beside the round in progress

    async def speculate(self, index: int, plan: RoundPlan) -> Speculated:
        """SPECULATE: round T's draft to Verify(T), and Speculate(T) beside it."""
        gen = self.state
        lookup, self._lookup = self._lookup, None
        launch, self._launch = self._launch, None
        if launch is not None and launch.at == len(gen.committed):
            drafted = RoundDraft(launch.sent.draft, "ahead", hit=True, wait_ms=lookup.wait_ms if lookup else 0.0)
            self._beside = launch.speculation
            return Speculated(drafted, launch.verify, launch.speculation, launch.speculated_early)
        if launch is not None:
            launch.cancel()
        drafted = await self._draft_round(index, lookup, plan)
        draft = drafted.draft
        verify = asyncio.ensure_future(
            self._target.verify(gen.target_session, gen.committed, draft.tokens, draft.dists, gen.sampling, gen.return_logprobs)
        )
        # Speculate only if another round may follow this one (k = 0 commits one token).
        speculation = None
        if drafted.speculates and self._tree_fits(gen.committed, draft.tokens):
            speculation = self._speculator.beside(index, gen.committed, draft.tokens)
        self._beside = speculation
        return Speculated(drafted, verify, speculation)

    async def _draft_round(self, index: int, lookup: Lookup | None, plan: RoundPlan) -> RoundDraft:
        """Round T's draft: the cache hit, none (round 0, or one token left), or the backup's."""
        gen, draft = self.state, self._draft
        if not (gen.mode == SSD and draft is not None and draft.usable()):
            reason = draft.last_error if draft is not None else "no draft worker is configured"
            # The Speculate beside the last verify failed (and marked the draft down): its lookup
            # still missed, and says why, as any other miss.
            failed = lookup is not None and lookup.miss == MISS_FAILED
            return RoundDraft(_NO_DRAFT, hit=False if failed else None, miss=MISS_FAILED if failed else "", fallback=reason, speculates=False)
        if plan.num_draft <= 0:  # many requests run, or auto measured target-only faster: a plain target step
            return RoundDraft(_NO_DRAFT, speculates=False, target_only=plan.target_only)
        num_draft = min(plan.num_draft, gen.remaining - 1)
        if num_draft <= 0:
            return RoundDraft(_NO_DRAFT)
        waited_ms = lookup.wait_ms if lookup is not None else 0.0
        if lookup is not None and lookup.draft is not None and lookup.at == len(gen.committed):
            hit = lookup.draft
            return RoundDraft(Draft(hit.tokens[:num_draft], hit.dists[:num_draft]), "cache", hit=True, wait_ms=waited_ms)
        if index == 0:  # round 0 verifies the prompt's prefill and drafts nothing (ssd_rounds)
            return RoundDraft(_NO_DRAFT)
        miss = lookup.miss if lookup is not None else MISS_NO_SPECULATION
        started = time.perf_counter()
        try:
            backup = await draft_after_miss(gen, draft, self._config, plan.backup, num_draft)
        except DraftFailed as exc:
            waited_ms += (time.perf_counter() - started) * 1000.0
            return RoundDraft(_NO_DRAFT, "", False, miss, plan.backup, str(exc), waited_ms, speculates=False)
        waited_ms += (time.perf_counter() - started) * 1000.0
        return RoundDraft(Draft(backup.tokens, backup.dists), backup.source, False, miss, backup.source, wait_ms=waited_ms)

    async def verify(self, round: Speculated) -> Verified:
        """VERIFY: wait for Verify(T); a cache built first goes on ahead (ssd_speculator)."""
        speculation = round.speculation
        try:
            if speculation is not None and (cache := await self._speculator.built_first(speculation, round.verify)):
                self._send_ahead(speculation, cache)
            response = await round.verify
        except BaseException:
            round.verify.cancel()  # a no-op once it answered
            if speculation is not None:
                speculation.task.cancel()
            raise
        tokens = round.drafted.draft.tokens
        self.state.policy.verified(len(tokens), response.accepted)
        return Verified(response, tokens[: response.accepted] + [response.next_token])

    async def look_up(self, round: Speculated, verified: Verified) -> Lookup:
        """LOOK UP: Verify(T)'s outcome in the cache built beside it, once it is in."""
        at = len(self.state.committed) + len(verified.tokens)
        if round.speculation is None:
            return Lookup(at, None)
        started = time.perf_counter()
        collected = await self._speculator.collect(
            round.speculation, verified.outcome, verified.response.forward_ms, self.state.policy.backup
        )
        wait_ms = (time.perf_counter() - started) * 1000.0
        cache = collected.cache
        if cache is None:
            return Lookup(at, None, collected.miss, collected.failure, wait_ms)
        found = cache.lookup(verified.outcome)
        if found is None:
            return Lookup(at, None, MISS_UNCOVERED, "", wait_ms, cache.forward_ms)
        return Lookup(at, found.draft(), "", "", wait_ms, cache.forward_ms)

    def start_next(self, index: int, verified: Verified, lookup: Lookup) -> None:
        """Keep round `index`'s lookup; on a hit sent ahead, round `index` is on the target
        already: start the Speculate beside it now, before the caller takes the previous
        round's tokens, in round `index`'s span."""
        self._lookup = lookup
        sent = self._ahead.take(verified.outcome)  # cancels the call on a miss
        if sent is None:
            self._speculator.discard()
            return
        with self.state.trace.ahead(index):
            self._launch = self._launch_ahead(index, sent, self.state.committed + verified.tokens)

    def _launch_ahead(self, index: int, sent: SentAhead, committed: list[int]) -> _Launch:
        """Round `index`, its verify sent ahead: wait for its answer, and the Speculate beside it."""
        verify = asyncio.ensure_future(self._ahead.answer(sent, committed))
        # The Speculate started early for this outcome, if it came true; else one starts now,
        # as any round's: if another round may follow and the draft is up (it was a moment ago).
        speculation = self._speculator.adopt(committed, sent.draft.tokens, verify)
        early = speculation is not None
        if early and (cache := self._speculator.take_built(speculation, verify)):  # its cache may be in already
            self._send_ahead(speculation, cache)
        if not early and self._tree_fits(committed, sent.draft.tokens):
            speculation = self._speculator.beside(index, committed, sent.draft.tokens)
        return _Launch(len(committed), sent, verify, speculation, early)

    def _send_ahead(self, speculation: Speculation, cache: SpeculationCache) -> None:
        """A cache in before the verify it was built beside answered: round T+1's verify for each
        cached outcome goes to the target now, and Speculate(T+1) starts early for the likeliest,
        in round T+1's span (its work, started during round T)."""
        max_k = speculation.num_tokens
        with self.state.trace.ahead(speculation.index + 1):
            self._ahead.send(speculation.committed, speculation.verifying, cache, lambda remaining: min(max_k, remaining - 1))
            self._speculator.speculate_early(speculation, cache)

    def _tree_fits(self, committed: list[int], verifying: list[int]) -> bool:
        """Whether a Speculate beside this verify may be of use: the draft is up (the link is
        shared: another request's failed call may have marked it down while this round awaited
        its backup), branches in the budget, another round may follow it (k = 0 commits one
        token), and the draft's context has room for a branch to draft at least one token."""
        return (
            self._draft is not None
            and self._draft.info is not None
            and bool(self.state.policy.budget)
            and self.state.max_len - len(committed) > 1
            and self._speculator.tree_tokens(len(committed), len(verifying)) > 0
        )

    def result(self, index: int, round: Speculated, verified: Verified, lookup: Lookup) -> RoundResult:
        drafted, response = round.drafted, verified.response
        fallback = drafted.fallback or lookup.failure
        return RoundResult(
            index=index,
            mode=SSD if drafted.draft.tokens or (round.speculation is not None and not fallback) else OFF,
            tokens=verified.tokens,
            logprobs=list(response.logprobs),
            num_draft=len(drafted.draft.tokens),
            accepted=response.accepted,
            bonus=response.next_token_kind == target_pb2.NEXT_TOKEN_KIND_BONUS,
            draft_wait_ms=drafted.wait_ms,
            verify_ms=response.forward_ms,
            fallback_reason=fallback,
            hit=drafted.hit,
            miss=drafted.miss,
            backup=drafted.backup,
            branches=round.speculation.branches if round.speculation is not None else 0,
            speculate_ms=lookup.speculate_ms,
            verified_ahead=drafted.source == "ahead" and self._ahead.answered_ahead,
            speculated_early=round.speculated_early,
            target_only=drafted.target_only,
        )

    def close(self) -> None:
        """Cancel whatever is still in flight: the request ended. (A Speculate left running
        could reach the draft after the request's EndSession and hold a session there.)"""
        if self._beside is not None:
            self._beside.task.cancel()  # a no-op once it has ended
        if self._launch is not None:
            self._launch.cancel()
        self._speculator.discard()
        self._ahead.cancel()


async def ssd_round(request: SsdRequest, index: int) -> RoundResult:
    """Round `index`: SPECULATE, VERIFY, LOOK UP, in its span (opened already if its work
    started during the previous round); work for the next round opens that one's span."""
    with request.state.trace.round(index) as span:
        plan = request.state.policy.plan()
        span.record_plan(plan)
        speculated = await request.speculate(index, plan)
        verified = await request.verify(speculated)
        lookup = await request.look_up(speculated, verified)
        request.start_next(index + 1, verified, lookup)
        result = request.result(index, speculated, verified, lookup)
        span.record(result)
    return result


async def ssd_rounds(state: RequestState, target: TargetLink, draft: DraftLink | None, config: CoordinatorConfig) -> AsyncIterator[RoundResult]:
    """Speculative speculative decoding; target-only rounds when the draft is off or away.

    Round 0 verifies no draft: its Verify carries the whole prompt, so the target's prefill
    is that forward and its last position gives the first token, while the draft takes the
    prompt with round 0's Speculate and builds round 1's cache beside it (a prefill outlasts
    any tree, so round 1 is a hit sent ahead). A Propose for round 0 would have the target
    prefill and then verify separately, one more forward and one more trip per request.
    """
    request = SsdRequest(state, target, draft, config)
    try:
        index = 0
        while state.remaining > 0:
            yield await ssd_round(request, index)
            index += 1
    finally:
        request.close()
