"""ssd's SPECULATE side: a request's Speculate calls, and the wait for the cache they build.

- beside(): Speculate(T) goes out with Verify(T); the draft guesses Verify(T)'s outcomes
  (k, t*) - F_k guesses per k under the budget (the request's policy, coordinator/policy.py) -
  and drafts K' tokens after each (draft_service/speculation.py).
- built_first(): whether the cache came in while Verify(T) still runs; then the round loop sends
  round T+1's verifies ahead (coordinator/verify_ahead.py) and, with config.ssd_speculate_early,
  speculate_early() starts Speculate(T+1) for Verify(T)'s likeliest outcome: on a hit sent
  ahead the target runs round T+1 straight after round T, and a tree started only after two more
  trips would arrive after Verify(T+1). adopt() takes that early Speculate as round T+1's when
  its outcome came true; another outcome cancels it (discard()).
- collect(): the cache once built, or why not (Collected), within the draft wait bounds.

Whatever happens, the committed tokens stay the coordinator's: an early Speculate that is
dropped resets the draft session to what the draft surely holds.
"""

from __future__ import annotations

import asyncio
import dataclasses
import time

from coordinator.config import CoordinatorConfig
from coordinator.draft_link import DraftFailed, DraftLink
from coordinator.request_state import RequestState
from coordinator.speculation_cache import SpeculationCache
from specd.core.outcomes import Outcome
from specd.v1 import draft_pb2
from specd.wire.convert import sampling_to_proto

# Speculate early only for an outcome at least this likely: one that does not come true is
# cancelled, and the Speculate that replaces it waits for the draft's current tree step.
_EARLY_MIN_PROBABILITY = 0.5

# Why a round's cache lookup missed, on its span (`specd.round.miss`): the outcome was not among
# the guesses, the build was given up on, the Speculate call failed, or none was made for it.
MISS_UNCOVERED, MISS_LATE, MISS_FAILED, MISS_NO_SPECULATION = "uncovered", "late", "failed", "no_speculation"


def saguaro(config: CoordinatorConfig, state: RequestState, fanout: list[int]) -> draft_pb2.SaguaroParams | None:
    """Saguaro sampling for drafts whose positions will get `fanout` guesses; None when off."""
    if state.sampling.greedy or config.ssd_saguaro_c >= 1.0 or not fanout:
        return None
    return draft_pb2.SaguaroParams(c=config.ssd_saguaro_c, fanout=fanout)


@dataclasses.dataclass
class Speculation:
    """A Speculate call in flight beside the verify of `verifying` after `committed` (round
    `index`'s): the cache for the round after it."""

    index: int  # the round it runs beside; its call is a child of that round's span
    task: asyncio.Future  # -> SpeculationCache
    guesses: asyncio.Future  # -> the outcomes (k, t*) the cache will hold
    branches: int
    num_tokens: int  # K' drafted after each guess
    started: float  # time.perf_counter()
    committed: list[int]
    verifying: list[int]
    sent_ahead: bool = False  # its cache has gone on to the target (send_ahead)


@dataclasses.dataclass(frozen=True)
class Collected:
    """What collect() got: the cache, or why none (a MISS_* reason; `failure` when the draft failed)."""

    cache: SpeculationCache | None
    miss: str = ""
    failure: str = ""


class Speculator:
    """One request's Speculate calls: beside a verify, and early."""

    def __init__(self, state: RequestState, draft: DraftLink | None, config: CoordinatorConfig):
        self._state, self._draft, self._config = state, draft, config
        self._early: tuple[Speculation, int] | None = None  # and len(committed) the draft surely holds

    def tree_tokens(self, committed: int, verifying: int) -> int:
        """K' of a tree beside the verify of `verifying` tokens after `committed`: the policy's K,
        less near the end of the draft's context, which the deepest branch (all accepted, its
        t*, then K' drafted) must fit in; 0 or less: no tree fits. (Past max_len a branch drafts
        what no round will verify, as sd's Propose for that outcome would: not cut here.)"""
        return min(self._state.policy.k, self._draft.room(committed + verifying + 1))

    def beside(self, index: int, committed: list[int], verifying: list[int]) -> Speculation:
        """Start Speculate beside round `index`'s verify, of `verifying` after `committed`,
        in the current span (the caller's: that round's). The caller checks tree_tokens > 0."""
        state, policy = self._state, self._state.policy
        vocab = self._draft.info.vocab_size
        fanout = policy.fanout(len(verifying), vocab)
        num_tokens = self.tree_tokens(len(committed), len(verifying))
        assert num_tokens > 0, (len(committed), len(verifying), state.max_len)
        request = draft_pb2.SpeculateRequest(
            session_id=state.session_id,
            draft_tokens=verifying,
            num_tokens=num_tokens,
            fanout=fanout,
            sampling=sampling_to_proto(state.sampling),
            max_support=state.max_support,
            saguaro=saguaro(self._config, state, policy.fanout(policy.k, vocab)[: policy.k]),
        )
        guesses = asyncio.get_running_loop().create_future()
        committed = list(committed)  # as it stands now: the caller's list grows when this round commits
        task = asyncio.ensure_future(self._draft.speculate(state.draft_session, committed, request, guesses))
        return Speculation(index, task, guesses, sum(fanout), num_tokens, time.perf_counter(), committed, list(verifying))

    async def built_first(self, speculation: Speculation, verify: asyncio.Future) -> SpeculationCache | None:
        """Wait for `verify` or the cache beside it, whichever comes first: the cache, if it came
        while `verify` still runs and has not gone ahead yet (the loop calls this while it waits)."""
        if not self._config.ssd_verify_ahead:
            return None
        if not speculation.task.done():
            await asyncio.wait({speculation.task, verify}, return_when=asyncio.FIRST_COMPLETED)
        caught_up = self._state.target_session.caught_up
        if not caught_up.is_set() and not verify.done():
            # The verify still sends a long prompt ahead of itself: a VerifyAfter sent now would
            # spend its deadline waiting behind those calls. It goes once the verify itself is out.
            waiting = asyncio.ensure_future(caught_up.wait())
            try:
                await asyncio.wait({waiting, verify}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                waiting.cancel()
        return self.take_built(speculation, verify)

    def take_built(self, speculation: Speculation, verify: asyncio.Future) -> SpeculationCache | None:
        """The cache, if it is in, `verify` has not answered and it has not gone ahead yet (it is now)."""
        task = speculation.task
        if not self._config.ssd_verify_ahead or speculation.sent_ahead or verify.done() or not task.done():
            return None
        if task.cancelled() or task.exception() is not None:
            return None
        speculation.sent_ahead = True
        return task.result()

    def speculate_early(self, speculation: Speculation, cache: SpeculationCache) -> None:
        """Speculate(T+1) for the likeliest outcome of the verify `speculation` ran beside."""
        self.discard()
        state, policy = self._state, self._state.policy
        if not self._config.ssd_speculate_early or self._draft is None or self._draft.info is None:
            return
        entry = _likeliest(cache, len(speculation.verifying), policy.acceptance.value)
        if entry is None:
            return
        emitted = speculation.verifying[: entry.accepted] + [entry.next_token]
        committed = speculation.committed + emitted
        count = min(speculation.num_tokens, state.max_len - len(committed) - 1)
        # As VerifyAhead.send: such an outcome gets a choice, and a round may follow it.
        if count <= 0 or not state.eos_token_ids.isdisjoint(emitted) or not policy.budget:
            return
        if self.tree_tokens(len(committed), count) <= 0:
            return
        self._early = (self.beside(speculation.index + 1, committed, entry.tokens[:count]), len(speculation.committed))

    def adopt(self, committed: list[int], verifying: list[int], verify: asyncio.Future) -> Speculation | None:
        """The early Speculate, if it speculates beside verifying `verifying` after `committed`
        (round T+1 as it came), now beside `verify`; else None, and it is cancelled."""
        early, self._early = self._early, None
        if early is None:
            return None
        speculation = early[0]
        if speculation.committed != committed or speculation.verifying != verifying or speculation.task.cancelled():
            self._drop(early)
            return None
        return speculation

    def discard(self) -> None:
        """Cancel the early Speculate: its outcome did not come, or the request ends."""
        early, self._early = self._early, None
        if early is not None:
            self._drop(early)

    def _drop(self, early: tuple[Speculation, int]) -> None:
        speculation, base = early
        speculation.task.cancel()
        self._state.draft_session.unsure_after(base)  # the draft may hold the assumed tokens

    async def collect(self, speculation: Speculation, outcome: Outcome, verify_ms: float, backup: str) -> Collected:
        """The cache once built, or why not.

        The stream names the outcomes it covers after its first forward: an outcome not among
        them is a miss at once, and the build is cancelled (it stops between tree steps) so that
        the backup does not wait for it. For a covered outcome, with the jit backup the loop
        waits for the build (a Propose would queue behind it on the draft's one model thread
        anyway); with the ngram backup it waits only while the build may still end soon, then
        gives up. Whatever the backup, a draft that has not sent what the round waits for
        within the draft wait (coordinator/draft_wait.py) is taken for hung: the build is
        cancelled and the draft marked down.
        """
        wait_s = self._state.draft_wait_s()
        hung_at = time.perf_counter() + wait_s
        give_up_at = self._give_up_at(speculation, verify_ms)
        try:
            if not await _guesses_within(speculation, hung_at):
                raise self._hung(speculation, wait_s)
            if speculation.guesses.done() and outcome not in speculation.guesses.result() and not speculation.task.done():
                speculation.task.cancel()
                return Collected(None, MISS_UNCOVERED)
            if backup == "ngram":
                if not await _built_within(speculation, min(give_up_at, hung_at)):
                    speculation.task.cancel()
                    return Collected(None, MISS_LATE)
            elif not await _built_within(speculation, hung_at):
                raise self._hung(speculation, wait_s)
            return Collected(await speculation.task)
        except DraftFailed as exc:
            return Collected(None, MISS_FAILED, str(exc))

    def _give_up_at(self, speculation: Speculation, verify_ms: float) -> float:
        """When the ngram backup stops waiting for a covered build (time.perf_counter())."""
        if self._config.ssd_wait_ms >= 0:
            return time.perf_counter() + self._config.ssd_wait_ms / 1000.0
        # The build was sized to end inside a verification; allow it half a verification more.
        return speculation.started + verify_ms * 1.5 / 1000.0

    def _hung(self, speculation: Speculation, wait_s: float) -> DraftFailed:
        """The round gave up on a draft that answered nothing in `wait_s`: cancel its build, mark it down."""
        speculation.task.cancel()
        return DraftFailed(self._draft.timed_out(wait_s))


async def _guesses_within(speculation: Speculation, until: float) -> bool:
    """Wait until the build names its guesses (or ends); False if neither came by `until`."""
    if not speculation.guesses.done():
        await asyncio.wait({speculation.guesses, speculation.task}, timeout=_left(until), return_when=asyncio.FIRST_COMPLETED)
    return speculation.guesses.done() or speculation.task.done()


async def _built_within(speculation: Speculation, until: float) -> bool:
    """Wait until the build ends; False if it did not by `until`."""
    if not speculation.task.done():
        await asyncio.wait({speculation.task}, timeout=_left(until))
    return speculation.task.done()


def _left(until: float) -> float:
    """Seconds from now to `until` (time.perf_counter()), none if it has passed."""
    return max(0.0, until - time.perf_counter())


def _likeliest(cache: SpeculationCache, num_draft: int, acceptance: float):
    """The cache entry for the outcome the acceptance makes likeliest, if likely enough.

    k accepted has probability a^k (1 - a) for k < K and a^K for k = K (capped geometric): the
    likeliest is K or 0. Among its guesses the draft's first-ranked.
    """
    a = acceptance
    k, probability = (num_draft, a**num_draft) if a**num_draft >= 1 - a else (0, 1 - a)
    if probability < _EARLY_MIN_PROBABILITY:
        return None
    return cache.first_with(k)
