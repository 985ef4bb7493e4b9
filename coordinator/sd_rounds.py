"""The sd round loop: draft, verify, for one request; target-only rounds when it drafts nothing.

A round: the policy's plan (coordinator/policy.py) says how many tokens to draft; the draft
proposes them (round 0's Propose runs beside the target's prefill of the prompt); the target
verifies them in one forward and answers (k accepted, t*). Target-only decoding (`off`, a busy
server, a draft that is down) is the same round with nothing drafted.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from typing import AsyncIterator

from coordinator.draft_link import DraftFailed, DraftLink
from coordinator.draft_wait import answer_within
from coordinator.request_state import RequestState
from coordinator.round_result import RoundResult
from coordinator.target_link import TargetLink
from specd.core.sampling import SparseDist
from specd.v1 import target_pb2
from specd.wire.convert import sparse_list_from_proto
from specd.wire.modes import OFF, SD


def start_target_prefill(state: RequestState, target: TargetLink) -> None:
    """Start filling the target's cache with the prompt; round 0 awaits it before verifying.

    Meanwhile round 0's Propose feeds the prompt to the draft and drafts in one call, so the
    draft's prefill and first draft cost no time beside the target's prefill. (ssd's round 0
    verifies no draft, so its Verify does the prefill: coordinator/ssd_rounds.py.)
    """
    state.target_prefill = asyncio.ensure_future(target.prefill(state.target_session, state.committed))


async def sd_rounds(state: RequestState, target: TargetLink, draft: DraftLink | None) -> AsyncIterator[RoundResult]:
    """Synchronous speculative decoding; target-only rounds when the draft is off or away."""
    start_target_prefill(state, target)
    index = 0
    while state.remaining > 0:
        with state.trace.round(index) as span:  # the round's worker calls are its children
            plan = state.policy.plan()
            span.record_plan(plan)
            result = await _sd_round(state, target, draft, index, plan.num_draft, plan.target_only)
            span.record(result)
        yield result
        index += 1


async def _sd_round(
    state: RequestState, target: TargetLink, draft: DraftLink | None, index: int, planned: int, target_only: str
) -> RoundResult:
    num_draft = min(planned, state.remaining - 1)
    if draft is not None:  # a draft whose context is shorter than the target's stops drafting at its end
        num_draft = min(num_draft, draft.room(len(state.committed)))
    drafted = await _draft_beside_prefill(state, draft, num_draft)
    verify_started = time.perf_counter()
    verify = await target.verify(
        state.target_session, state.committed, drafted.tokens, drafted.dists, state.sampling, state.return_logprobs
    )
    verify_wall_ms = (time.perf_counter() - verify_started) * 1000.0
    # Round 0's draft wait holds the prompt's prefill: not a cost of drafting.
    state.policy.verified(len(drafted.tokens), verify.accepted, None if index == 0 else (drafted.wait_ms, verify_wall_ms))
    return RoundResult(
        index=index,
        mode=drafted.mode,
        tokens=drafted.tokens[: verify.accepted] + [verify.next_token],
        logprobs=list(verify.logprobs),
        num_draft=len(drafted.tokens),
        accepted=verify.accepted,
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


async def _draft_beside_prefill(state: RequestState, draft: DraftLink | None, num_draft: int) -> _Drafted:
    """The round's Propose, waited for no longer than state.draft_wait_s(); with the target's
    prefill awaited first (round 0's Propose runs beside it, and its wait is counted from the
    prefill's end, so that a long prompt's prefill on the draft is not taken for a hang)."""
    if state.mode == OFF or num_draft <= 0:
        await state.target_prefilled()
        return _Drafted(OFF, [], [], 0.0, "")
    if draft is None or not draft.usable():
        await state.target_prefilled()
        return _Drafted(OFF, [], [], 0.0, draft.last_error if draft is not None else "no draft worker is configured")
    started = time.perf_counter()
    proposal = asyncio.ensure_future(
        draft.propose(state.draft_session, state.committed, num_draft, state.sampling, state.max_support)
    )
    try:
        await state.target_prefilled()
        response = await answer_within(draft, proposal, state.draft_wait_s())
    except DraftFailed as exc:
        return _Drafted(OFF, [], [], (time.perf_counter() - started) * 1000.0, str(exc))
    except BaseException:
        proposal.cancel()  # the prefill failed, or the request ended
        if proposal.done() and not proposal.cancelled():
            proposal.exception()  # retrieved, so that asyncio does not log it
        raise
    waited_ms = (time.perf_counter() - started) * 1000.0
    return _Drafted(SD, list(response.draft_tokens), sparse_list_from_proto(response.draft_probs), waited_ms, "")
