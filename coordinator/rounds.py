"""The round loop: draft, verify, commit, for one request.

The loop yields one RoundResult per target forward; its consumer commits the emitted
tokens (perhaps fewer, at a stop condition) to `Generation.committed` before asking
for the next round, so the loop always drafts after exactly what was committed.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

from coordinator.draft_wait import DraftWait, answer_within
from coordinator.load import UNLIMITED, SpeculationLoad
from coordinator.payoff import SpeculationPayoff
from coordinator.round_trace import RoundTrace
from coordinator.speculation_gain import SpeculationGain
from coordinator.draft_link import DraftFailed, DraftLink
from coordinator.target_link import TargetLink
from coordinator.workers import WorkerSession
from specd.modes import OFF, SD
from specd.sampling import SamplingSettings, SparseDist
from specd.v1 import target_pb2


@dataclasses.dataclass
class Generation:
    """A request's state, owned by the coordinator."""

    session_id: str
    committed: list[int]  # prompt + generated so far
    sampling: SamplingSettings
    mode: str  # ssd, sd or off (auto is resolved before)
    num_speculative_tokens: int
    max_support: int
    return_logprobs: bool
    max_len: int  # committed may grow to this many tokens
    eos_token_ids: frozenset[int] = frozenset()  # tokens that end the request (none with ignore_eos)
    trace: RoundTrace = dataclasses.field(default_factory=RoundTrace)  # the request's round spans
    target_prefill: asyncio.Future | None = None  # the prompt's prefill, until round 0 awaits it
    draft_wait: DraftWait = dataclasses.field(default_factory=DraftWait)  # how long a round waits for the draft
    # How much to speculate with this many requests running (and, for `auto`, whether it pays:
    # a SpeculationGain, coordinator/speculation_gain.py).
    load: SpeculationLoad | SpeculationGain = UNLIMITED
    payoff: SpeculationPayoff | None = None  # greedy sd under load: the K that pays (else the load's)
    target_session: WorkerSession = dataclasses.field(init=False)
    draft_session: WorkerSession = dataclasses.field(init=False)

    def __post_init__(self) -> None:
        self.target_session = WorkerSession(self.session_id)
        self.draft_session = WorkerSession(self.session_id)

    def draft_wait_s(self) -> float:
        """How long this round may wait for the draft: scaled by the latest worker calls' times."""
        return self.draft_wait.seconds(self.target_session.call_ms, self.draft_session.call_ms)


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
    miss: str = ""  # why a lookup missed: uncovered, late, failed or no_speculation (see ssd_rounds)
    backup: str = ""
    branches: int = 0
    speculate_ms: float = 0.0  # the draft worker's forwards for those branches
    verified_ahead: bool = False  # the target verified it right after the previous round (VerifyAfter)
    speculated_early: bool = False  # ssd: its tree was started before the previous round's verify answered
    target_only: str = ""  # why a speculating request's round drafted nothing: load.UNDER_LOAD or load.NO_GAIN


def start_target_prefill(gen: Generation, target: TargetLink) -> None:
    """sd and target-only: start filling the target's cache with the prompt; round 0 awaits
    it before verifying.

    Meanwhile sd's round 0 drafts: its Propose feeds the prompt to the draft and drafts in one
    call, so the draft's prefill and first draft cost no time beside the target's prefill.
    (ssd's round 0 verifies no draft, so its Verify does the prefill: coordinator/ssd_rounds.py.)
    """
    gen.target_prefill = asyncio.ensure_future(target.prefill(gen.target_session, gen.committed))


async def target_prefilled(gen: Generation) -> None:
    """Wait for the target's prefill, if one is under way; raises what it raised."""
    if gen.target_prefill is not None:
        prefill, gen.target_prefill = gen.target_prefill, None
        await prefill


def drop_target_prefill(gen: Generation) -> None:
    """Cancel a prefill nobody will await (the request ended first), retrieving any error."""
    prefill, gen.target_prefill = gen.target_prefill, None
    if prefill is None:
        return
    if prefill.done():
        if not prefill.cancelled():
            prefill.exception()
    else:
        prefill.cancel()


async def sd_rounds(gen: Generation, target: TargetLink, draft: DraftLink | None) -> AsyncIterator[RoundResult]:
    """Synchronous speculative decoding; target-only rounds when the draft is off or away."""
    index = 0
    while (remaining := gen.max_len - len(gen.committed)) > 0:
        with gen.trace.round(index) as span:  # the round's worker calls are its children
            result = await _sd_round(gen, target, draft, index, remaining)
            span.record(result)
        yield result
        index += 1


async def _sd_round(gen: Generation, target: TargetLink, draft: DraftLink | None, index: int, remaining: int) -> RoundResult:
    asked = gen.num_speculative_tokens
    allowed = gen.payoff.k(asked) if gen.payoff is not None else gen.load.k(asked)
    target_only = gen.load.target_only() if gen.mode != OFF and asked > 0 and allowed <= 0 else ""
    num_draft = min(allowed, remaining - 1)
    if draft is not None:  # a draft whose context is shorter than the target's stops drafting at its end
        num_draft = min(num_draft, draft.room(len(gen.committed)))
    drafted = await _draft_beside_prefill(gen, draft, num_draft)
    draft_tokens, draft_dists = drafted.tokens, drafted.dists
    verify_started = time.perf_counter()
    verify = await target.verify(
        gen.target_session, gen.committed, draft_tokens, draft_dists, gen.sampling, gen.return_logprobs
    )
    accepted = verify.accepted
    if gen.payoff is not None:
        verify_wall_ms = (time.perf_counter() - verify_started) * 1000.0
        # Round 0's draft wait holds the prompt's prefill: not a cost of drafting.
        gen.payoff.observe_round(len(draft_tokens), accepted, None if index == 0 else (drafted.wait_ms, verify_wall_ms))
    return RoundResult(
        index=index,
        mode=drafted.mode,
        tokens=draft_tokens[:accepted] + [verify.next_token],
        logprobs=list(verify.logprobs),
        num_draft=len(draft_tokens),
        accepted=accepted,
        bonus=verify.next_token_kind == target_pb2.NEXT_TOKEN_KIND_BONUS,
        draft_wait_ms=drafted.wait_ms,
        verify_ms=verify.forward_ms,
        fallback_reason=drafted.fallback,
        target_only=target_only,
    )


@dataclasses.dataclass(frozen=True)
class _Drafted:
    mode: str  # sd if the draft proposed, else off
    tokens: list[int]
    dists: list[SparseDist]
    wait_ms: float  # time the round waited on the draft worker
    fallback: str  # why the round drafted nothing, if it was to speculate


async def _draft_beside_prefill(gen: Generation, draft: DraftLink | None, num_draft: int) -> _Drafted:
    """sd: the round's Propose, waited for no longer than gen.draft_wait_s(); with the target's
    prefill awaited first (round 0's Propose runs beside it, and its wait is counted from the
    prefill's end, so that a long prompt's prefill on the draft is not taken for a hang)."""
    if gen.mode == OFF or num_draft <= 0:
        await target_prefilled(gen)
        return _Drafted(OFF, [], [], 0.0, "")
    if draft is None or not draft.usable():
        await target_prefilled(gen)
        return _Drafted(OFF, [], [], 0.0, draft.last_error if draft is not None else "no draft worker is configured")
    started = time.perf_counter()
    proposal = asyncio.ensure_future(draft.propose(gen.draft_session, gen.committed, num_draft, gen.sampling, gen.max_support))
    try:
        await target_prefilled(gen)
        response = await answer_within(draft, proposal, gen.draft_wait_s())
    except DraftFailed as exc:
        return _Drafted(OFF, [], [], (time.perf_counter() - started) * 1000.0, str(exc))
    except BaseException:
        proposal.cancel()  # the prefill failed, or the request ended
        if proposal.done() and not proposal.cancelled():
            proposal.exception()  # retrieved, so that asyncio does not log it
        raise
    dists = [SparseDist(list(d.token_ids), list(d.probs)) for d in response.draft_probs]
    return _Drafted(SD, list(response.draft_tokens), dists, (time.perf_counter() - started) * 1000.0, "")
