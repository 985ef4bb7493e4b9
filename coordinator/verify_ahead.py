"""ssd: round T+1's verify, sent to the target while it still verifies round T (VerifyAfter).

When the speculation cache arrives before Verify(T) has answered, the coordinator sends the
target one choice per cached outcome (k, t*): round T+1's verify with that entry's draft. The
target runs the choice written for its outcome right after round T's forward, so on a hit the
answer's trip back and the next Verify's trip out leave the critical path. The coordinator still
owns the committed tokens: each choice carries the committed tail its outcome implies, and the
round loop takes a choice's answer only for the outcome Verify(T) reports. On a miss the call is
cancelled; the target ran nothing for it (no choice matched).
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Callable

from coordinator.request_state import RequestState
from coordinator.speculation_cache import CachedDraft, Draft, SpeculationCache
from coordinator.target_link import TargetLink, verify_request
from specd.core.outcomes import Outcome
from specd.v1 import common_pb2, target_pb2


@dataclasses.dataclass(frozen=True)
class SentAhead:
    """Round T+1's draft for the outcome Verify(T) reported, and the call that verifies it."""

    draft: Draft
    call: asyncio.Future  # -> target_pb2.VerifyAfterResponse
    deadline: float  # the call's (time.monotonic()), which a Verify standing in for it shares

    def cancel(self) -> None:
        cancel_unawaited(self.call)


def cancel_unawaited(call: asyncio.Future) -> None:
    """Cancel a call nobody will await, retrieving its error if it already ended with one."""
    call.cancel()
    if call.done() and not call.cancelled():
        call.exception()  # retrieved, so that asyncio does not log it


class VerifyAhead:
    """A request's VerifyAfter call in flight, if any, and the draft each of its choices verifies."""

    def __init__(self, state: RequestState, target: TargetLink):
        self._state = state
        self._target = target
        self._call: asyncio.Future | None = None
        self._deadline = 0.0  # that of the call in flight
        # Each choice's cache entry and how many of its draft tokens the choice verifies.
        self._choices: dict[Outcome, tuple[CachedDraft, int]] = {}
        self.answered_ahead = False  # the latest answer() came from the verify sent ahead

    def send(
        self,
        committed: list[int],
        verifying: list[int],
        cache: SpeculationCache,
        num_draft: Callable[[int], int],
    ) -> None:
        """Offer the target round T+1 for every cached outcome of verifying `verifying` after
        `committed`.

        `num_draft(remaining)` is round T+1's K when `remaining` tokens may still be generated.
        Outcomes that end the request (no room left, or an EOS emitted) get no choice.
        """
        gen = self._state
        after = len(committed)
        choices = []
        for cached in cache:
            emitted = verifying[: cached.accepted] + [cached.next_token]  # d_1..d_k, t*
            count = num_draft(gen.max_len - after - len(emitted))
            if count <= 0 or not gen.eos_token_ids.isdisjoint(emitted):
                continue
            tail = common_pb2.CommittedTokens(start=after, token_ids=emitted)
            wire = cached.entry  # forwarded as the draft sent it
            request = verify_request(
                gen.session_id, tail, wire.draft_tokens[:count], wire.draft_probs[:count], gen.sampling, gen.return_logprobs
            )
            choices.append(target_pb2.VerifyChoice(accepted=cached.accepted, next_token=cached.next_token, verify=request))
            self._choices[cached.outcome] = (cached, count)
        if choices:
            self._deadline = self._target.deadline()
            self._call = asyncio.ensure_future(self._target.verify_after(gen.session_id, after, choices, self._deadline))

    def take(self, outcome: Outcome) -> SentAhead | None:
        """What was sent ahead for Verify(T)'s `outcome`, now the caller's to await (answer())
        or cancel; None, and the call cancelled, if nothing was."""
        choice = self._choices.get(outcome) if self._call is not None else None
        if choice is None:
            self.cancel()
            return None
        cached, count = choice
        # Only the winning entry's q is turned into SparseDists: the fallback Verify needs them.
        sent = SentAhead(cached.draft(count), self._call, self._deadline)
        self._call, self._choices = None, {}
        return sent

    async def answer(self, sent: SentAhead, committed: list[int]) -> target_pb2.VerifyResponse:
        """Round T+1's verify after `committed` (round T's tokens included): the answer to the
        choice sent ahead, or the same draft verified now if that call failed. The two share
        one deadline: a hung target fails the round within one worker timeout, not two."""
        gen, draft = self._state, sent.draft
        try:
            response = await sent.call
        except Exception:  # noqa: BLE001 - the plain Verify below re-syncs or reports the target's state
            response = None
        self.answered_ahead = response is not None and response.matched
        if self.answered_ahead:
            gen.target_session.answered(committed, response.verify.cached_tokens)
            return response.verify
        return await self._target.verify(
            gen.target_session, committed, draft.tokens, draft.dists, gen.sampling, gen.return_logprobs, sent.deadline
        )

    def cancel(self) -> None:
        if self._call is not None:
            cancel_unawaited(self._call)
        self._call, self._choices = None, {}
