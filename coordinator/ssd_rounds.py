"""The SSD round loop (Saguaro): verify round T while the draft speculates round T+1.

Each round reads as SPECULATE / VERIFY / LOOK UP:
- Verify(T) and Speculate(T) go out together. Speculate asks the draft worker to guess the
  outcome (k, t*) of Verify(T) - F_k guesses per k, geometric fan-out under a budget B - and
  to draft K' tokens after each guess (draft_service/speculation.py).
- When Verify(T) returns, its (k, t*) is looked up in the speculation cache. A hit is round
  T+1's draft, ready with no draft call on the critical path; a miss takes the backup
  (config.ssd_backup): a just-in-time Propose, or a prompt-lookup guess costing no model call.
- With config.ssd_verify_ahead, a cache that arrives while Verify(T) still runs goes to the
  target at once as round T+1's verify for each cached outcome (coordinator/verify_ahead.py):
  on a hit the target starts round T+1 right after round T's forward, and the loop starts
  Speculate(T+1) beside it before handing round T's tokens to the caller. Such a round's
  worker calls are children of round T's span. With config.ssd_speculate_early, that
  Speculate(T+1) starts as soon as the cache is in, for Verify(T)'s likeliest outcome
  (_Speculator.early); another outcome cancels it.
- Every Speculate and Propose carries the committed tail, so the draft's KV cache follows the
  committed tokens whichever branch won. A draft failure turns the rounds target-only until
  the draft is back, as in sd.

Exactness: any q is exact as long as the verifier gets the q the draft sampled from, and each
cache entry carries its own. Which q a round uses depends on timing, so ssd is
distribution-exact rather than seed-reproducible (DESIGN.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from typing import AsyncIterator

from coordinator.backup import one_hot, prompt_lookup
from coordinator.config import CoordinatorConfig
from coordinator.draft_wait import answer_within
from coordinator.rounds import Generation, RoundResult
from coordinator.ssd_tuning import Sizing, Tuning
from coordinator.verify_ahead import SentAhead, VerifyAhead, cancel_unawaited
from coordinator.workers import DraftFailed, DraftLink, TargetLink
from specd.sampling import SparseDist
from specd.v1 import draft_pb2, target_pb2
from specd.wire import sampling_to_proto

@dataclasses.dataclass
class Drafts:
    tokens: list[int]
    dists: list[SparseDist]
    source: str  # cache, ahead (a cache hit already sent to the target), jit or ngram ("" for none)


def _saguaro(config: CoordinatorConfig, gen: Generation, fanout: list[int]) -> draft_pb2.SaguaroParams | None:
    """Saguaro sampling for drafts whose positions will get `fanout` guesses; None when off."""
    if gen.sampling.greedy or config.ssd_saguaro_c >= 1.0 or not fanout:
        return None
    return draft_pb2.SaguaroParams(c=config.ssd_saguaro_c, fanout=fanout)


@dataclasses.dataclass
class _Speculation:
    """A Speculate call in flight: the cache for the round after the one it speculates beside."""

    task: asyncio.Future  # -> draft_pb2.SpeculationCache
    guesses: asyncio.Future  # -> the outcomes (k, t*) the cache will hold
    branches: int
    num_tokens: int  # K' drafted after each guess
    started: float
    budget: int  # the budget its fan-out was sized under
    committed: list[int]  # the committed tokens of the verify it speculates beside
    verifying: list[int]  # that verify's draft tokens


@dataclasses.dataclass
class _Launch:
    """Round T+1 started before round T was handed to the caller: a hit whose verify went
    ahead to the target, and the Speculate beside it."""

    drafts: Drafts
    sent: SentAhead
    verify: asyncio.Future  # -> its VerifyResponse, from the call sent ahead
    speculation: _Speculation | None
    budget: int | None  # the budget the round tries, as any round's
    committed: int  # len(committed) the round continues
    speculated_early: bool = False  # its Speculate started before round T's verify answered

    def cancel(self) -> None:
        cancel_unawaited(self.verify)
        self.sent.cancel()
        if self.speculation is not None:
            self.speculation.task.cancel()


def _speculate(
    gen: Generation,
    committed: list[int],
    drafts: Drafts,
    draft: DraftLink,
    config: CoordinatorConfig,
    tuning: Tuning,
) -> _Speculation:
    """Start Speculate beside the verify of `drafts` after `committed`."""
    vocab = draft.info.vocab_size
    next_k = tuning.k
    fanout = tuning.fanout(len(drafts.tokens), vocab, config.ssd_fanout_r)
    request = draft_pb2.SpeculateRequest(
        session_id=gen.session_id,
        draft_tokens=drafts.tokens,
        num_tokens=next_k,
        fanout=fanout,
        sampling=sampling_to_proto(gen.sampling),
        max_support=gen.max_support,
        saguaro=_saguaro(config, gen, tuning.fanout(next_k, vocab, config.ssd_fanout_r)[:next_k]),
    )
    guesses = asyncio.get_running_loop().create_future()
    committed = list(committed)  # as it stands now: the caller's list grows when this round commits
    task = asyncio.ensure_future(draft.speculate(gen.draft_session, committed, request, guesses))
    return _Speculation(task, guesses, sum(fanout), next_k, time.perf_counter(), tuning.budget, committed, list(drafts.tokens))


async def ssd_rounds(
    gen: Generation,
    target: TargetLink,
    draft: DraftLink | None,
    config: CoordinatorConfig,
    sizing: Sizing | None = None,
) -> AsyncIterator[RoundResult]:
    """Speculative speculative decoding; target-only rounds when the draft is off or away.

    Round 0 verifies no draft: its Verify carries the whole prompt, so the target's prefill
    is that forward and its last position gives the first token, while the draft takes the
    prompt with round 0's Speculate and builds round 1's cache beside it (a prefill outlasts
    any tree, so round 1 is a hit sent ahead). A Propose for round 0 would have the target
    prefill and then verify separately, one more forward and one more trip per request.
    `sizing` carries the budget learned from measured throughput across requests.
    """
    if sizing is None:
        sizing = Sizing(max_budget=config.ssd_budget)
    tuning = Tuning(
        max_k=gen.num_speculative_tokens,
        max_budget=config.ssd_budget,
        adaptive=config.ssd_adaptive,
        sizing=sizing,
    )
    ready: Drafts | None = None  # round T+1's draft from a cache hit, keyed to len(committed)
    ready_at = -1
    ready_wait_ms = 0.0  # what the loop waited on the draft to get it
    next_miss = ""  # if the next round misses, why (MISS_* below)
    ahead = VerifyAhead(gen, target)
    speculator = _Speculator(gen, draft, config, tuning, ahead)
    launch: _Launch | None = None  # this round, already under way
    last_round_end = time.perf_counter()
    index = 0
    try:
        while (remaining := gen.max_len - len(gen.committed)) > 0:
            with gen.trace.round(index) as span:  # Verify, Speculate and any Propose are its children
                num_draft = min(tuning.k, remaining - 1)
                fallback = ""
                hit: bool | None = None
                round_miss = ""
                backup = ""
                draft_wait_ms = 0.0
                drafts = Drafts([], [], "")
                speculation: _Speculation | None = None
                speculated_early = False
                round_budget: int | None = None  # the budget this round tries (0 probes a round with no cache)
                if launch is not None and launch.committed == len(gen.committed):
                    drafts, verify_task, speculation = launch.drafts, launch.verify, launch.speculation
                    speculated_early = launch.speculated_early
                    round_budget = launch.budget
                    hit, draft_wait_ms = True, ready_wait_ms
                    launch = None
                else:
                    if launch is not None:
                        launch.cancel()
                        launch = None
                    usable = gen.mode == "ssd" and draft is not None and draft.usable()
                    if not usable:
                        fallback = draft.last_error if draft is not None else "no draft worker is configured"
                    elif num_draft > 0 and ready is not None and ready_at == len(gen.committed):
                        drafts = Drafts(ready.tokens[:num_draft], ready.dists[:num_draft], "cache")
                        hit, draft_wait_ms = True, ready_wait_ms
                    elif num_draft > 0 and index > 0:  # round 0 drafts nothing: see ssd_rounds
                        hit = False
                        round_miss = next_miss
                        backup = config.ssd_backup
                        started = time.perf_counter()
                        try:
                            drafts = await _draft_without_cache(gen, draft, config, tuning, num_draft, backup)
                            backup = drafts.source
                        except DraftFailed as exc:
                            fallback, usable = str(exc), False
                        draft_wait_ms = ready_wait_ms + (time.perf_counter() - started) * 1000.0

                    verify_task = asyncio.ensure_future(
                        target.verify(gen.target_session, gen.committed, drafts.tokens, drafts.dists, gen.sampling, gen.return_logprobs)
                    )
                    # Speculate only if another round may follow this one (k = 0 commits one token).
                    round_budget = tuning.budget if usable and remaining > 1 else None
                    if round_budget:
                        speculation = speculator.beside(gen.committed, drafts, verify_task)
                ready, ready_at, ready_wait_ms = None, -1, 0.0
                next_miss = MISS_NO_SPECULATION
                try:
                    verify = await verify_task
                except BaseException:
                    if speculation is not None:
                        speculation.task.cancel()
                    raise
                accepted, next_token = verify.accepted, verify.next_token
                tuning.observe_round(len(drafts.tokens), accepted)

                # LOOK UP: round T+1's draft from the cache, if the build finishes in time.
                speculate_ms = 0.0
                # Round 0's verify is the prompt's prefill and its tree starts with the draft's:
                # neither says what a round's build and verification cost.
                sizes_builds = index > 0
                if speculation is not None:
                    waited = time.perf_counter()
                    outcome = (accepted, next_token)
                    cache = await _collect(speculation, outcome, config, verify.forward_ms, draft, gen.draft_wait_s())
                    ready_wait_ms = (time.perf_counter() - waited) * 1000.0
                    next_miss = _miss_reason(cache)
                    if isinstance(cache, DraftFailed):
                        fallback = str(cache)
                    elif cache is None:  # gave up waiting: the build outlasts the verification
                        waited_ms = (time.perf_counter() - speculation.started) * 1000.0
                        if sizes_builds:
                            tuning.observe_build(round_budget, waited_ms, verify.forward_ms, speculation.num_tokens + 1)
                    elif cache is not _KNOWN_MISS:
                        speculate_ms = cache.forward_ms
                        if cache.entries and sizes_builds:
                            tuning.observe_build(round_budget, speculate_ms, verify.forward_ms, speculation.num_tokens + 1)
                        ready = _entry_for(cache, (accepted, next_token))
                tokens = drafts.tokens[:accepted] + [next_token]
                ready_at = len(gen.committed) + len(tokens)
                # What a round costs per emitted token, at the budget it speculated with (a hit's
                # saving shows in the next round, which this average also takes in). Rounds may
                # overlap: a round's time runs from the previous round's end to its own.
                now = time.perf_counter()
                if round_budget is not None:
                    tuning.observe_time(round_budget, (now - last_round_end) * 1000.0, len(tokens))
                last_round_end = now
                # A hit whose verify went ahead: round T+1 is on the target already; start the
                # draft's Speculate beside it now, before the caller takes round T's tokens.
                sent = ahead.take((accepted, next_token))  # cancels the call on a miss
                if sent is not None:
                    launch = _start_ahead(gen, tokens, sent, draft, tuning, speculator)
                else:
                    speculator.discard()
                result = RoundResult(
                    index=index,
                    mode="ssd" if drafts.tokens or (speculation is not None and not fallback) else "off",
                    tokens=tokens,
                    logprobs=list(verify.logprobs),
                    num_draft=len(drafts.tokens),
                    accepted=accepted,
                    bonus=verify.next_token_kind == target_pb2.NEXT_TOKEN_KIND_BONUS,
                    draft_wait_ms=draft_wait_ms,
                    verify_ms=verify.forward_ms,
                    fallback_reason=fallback,
                    hit=hit,
                    miss=round_miss,
                    backup=backup,
                    branches=speculation.branches if speculation is not None else 0,
                    speculate_ms=speculate_ms,
                    verified_ahead=drafts.source == "ahead" and ahead.answered_ahead,
                    speculated_early=speculated_early,
                )
                span.record(result)
            yield result
            index += 1
    finally:
        if launch is not None:
            launch.cancel()
        speculator.discard()
        ahead.cancel()


async def _draft_without_cache(
    gen: Generation, draft: DraftLink, config: CoordinatorConfig, tuning: Tuning, num_draft: int, backup: str
) -> Drafts:
    """A miss's draft: a prompt-lookup guess (`ngram`) or a Propose call (`jit`).

    A lookup that finds no match would leave the round no draft at all, one token for a whole
    verification: the draft proposes instead (source `jit`).
    """
    if backup == "ngram":
        guess = prompt_lookup(gen.committed, num_draft)
        if guess:
            return Drafts(guess, one_hot(guess), "ngram")
        backup = "jit"
    vocab = draft.info.vocab_size
    saguaro = _saguaro(config, gen, tuning.fanout(num_draft, vocab, config.ssd_fanout_r)[:num_draft])
    proposal = draft.propose(gen.draft_session, gen.committed, num_draft, gen.sampling, gen.max_support, saguaro)
    response = await answer_within(draft, proposal, gen.draft_wait_s())
    dists = [SparseDist(list(d.token_ids), list(d.probs)) for d in response.draft_probs]
    return Drafts(list(response.draft_tokens), dists, backup)


def _entry_for(cache: draft_pb2.SpeculationCache, outcome: tuple[int, int]) -> Drafts | None:
    for entry in cache.entries:
        if (entry.accepted, entry.next_token) == outcome:
            dists = [SparseDist(list(d.token_ids), list(d.probs)) for d in entry.draft_probs]
            return Drafts(list(entry.draft_tokens), dists, "cache")
    return None


def _start_ahead(
    gen: Generation,
    tokens: list[int],
    sent: SentAhead,
    draft: DraftLink,
    tuning: Tuning,
    speculator: "_Speculator",
) -> _Launch:
    """Round T+1 from the draft sent ahead for round T's outcome, which emitted `tokens`."""
    committed = gen.committed + tokens
    drafts = Drafts(sent.draft.tokens, sent.draft.dists, "ahead")
    verify_task = asyncio.ensure_future(speculator.ahead.answer(sent, committed))
    # The Speculate started early for this outcome, if it came true; else one starts now, as
    # any round's: if another round may follow and the draft is up (it was a moment ago).
    speculation = speculator.adopt(committed, drafts.tokens, verify_task)
    if speculation is not None:
        return _Launch(drafts, sent, verify_task, speculation, speculation.budget, len(committed), speculated_early=True)
    budget = tuning.budget if gen.max_len - len(committed) > 1 and draft.info is not None else None
    if budget:
        speculation = speculator.beside(committed, drafts, verify_task)
    return _Launch(drafts, sent, verify_task, speculation, budget, len(committed))


# Speculate early only for an outcome at least this likely: one that does not come true is
# cancelled, and the Speculate that replaces it waits for the draft's current tree step.
_EARLY_MIN_PROBABILITY = 0.5


@dataclasses.dataclass
class _Early:
    """Speculate(T+1), started before Verify(T) answered, for an outcome of Verify(T)."""

    speculation: _Speculation
    base: int  # len(committed) before the assumed outcome: what the draft surely holds


class _Speculator:
    """A request's Speculate calls: beside a verify, and early.

    Early: on a hit sent ahead, the target runs round T+1 straight after round T; the tree
    beside it would be built only after two more trips (the answer to the coordinator,
    Speculate to the draft), and a tree that arrives after Verify(T+1) loses round T+2's head
    start. So Speculate(T+1) starts as soon as round T+1's cache is in, for round T's likeliest
    outcome, while the draft is idle; another outcome cancels it. Either way the committed
    tokens stay the coordinator's: the draft session is reset to what the draft surely holds.
    """

    def __init__(self, gen: Generation, draft: DraftLink | None, config: CoordinatorConfig, tuning: Tuning, ahead: VerifyAhead):
        self._gen, self._draft, self._config, self._tuning = gen, draft, config, tuning
        self.ahead = ahead
        self._pending: _Early | None = None

    def beside(self, committed: list[int], drafts: Drafts, verify_task: asyncio.Future) -> _Speculation:
        """Speculate beside `verify_task` (verifying `drafts` after `committed`); with verify
        ahead on, its cache goes on to the target as soon as it is in."""
        speculation = _speculate(self._gen, committed, drafts, self._draft, self._config, self._tuning)
        self._send_ahead_once_built(speculation, verify_task)
        return speculation

    def _send_ahead_once_built(self, speculation: _Speculation, verify_task: asyncio.Future) -> None:
        if self._config.ssd_verify_ahead:
            speculation.task.add_done_callback(functools.partial(self._send_ahead, verify_task, speculation))

    def _send_ahead(self, verify_task: asyncio.Future, speculation: _Speculation, spec_task: asyncio.Future) -> None:
        """Once the cache is in: send round T+1's verifies ahead if Verify(T) has not answered
        yet, and start Speculate(T+1) for Verify(T)'s likeliest outcome."""
        if verify_task.done() or spec_task.cancelled() or spec_task.exception() is not None:
            return
        cache = spec_task.result()
        max_k = speculation.num_tokens
        self.ahead.send(speculation.committed, speculation.verifying, cache, lambda remaining: min(max_k, remaining - 1))
        self.early(speculation, cache)

    def early(self, speculation: _Speculation, cache: draft_pb2.SpeculationCache) -> None:
        """Speculate(T+1) for the likeliest outcome of the verify `speculation` ran beside."""
        self.discard()
        gen, tuning = self._gen, self._tuning
        if not self._config.ssd_speculate_early or self._draft is None or self._draft.info is None:
            return
        entry = _likeliest(cache, len(speculation.verifying), tuning.acceptance)
        if entry is None:
            return
        emitted = speculation.verifying[: entry.accepted] + [entry.next_token]
        committed = speculation.committed + emitted
        count = min(speculation.num_tokens, gen.max_len - len(committed) - 1)
        # As VerifyAhead.send: such an outcome gets a choice, and a round may follow it.
        if count <= 0 or not gen.eos_token_ids.isdisjoint(emitted) or not tuning.budget:
            return
        drafts = Drafts(list(entry.draft_tokens[:count]), [], "ahead")
        self._pending = _Early(_speculate(gen, committed, drafts, self._draft, self._config, tuning), len(speculation.committed))

    def adopt(self, committed: list[int], verifying: list[int], verify_task: asyncio.Future) -> _Speculation | None:
        """The early Speculate, if it speculates beside verifying `verifying` after `committed`
        (round T+1 as it came), now beside `verify_task`; else None, and it is cancelled."""
        early, self._pending = self._pending, None
        if early is None:
            return None
        spec = early.speculation
        if spec.committed != committed or spec.verifying != verifying or spec.task.cancelled():
            self._drop(early)
            return None
        if spec.task.done():
            self._send_ahead(verify_task, spec, spec.task)
        else:
            self._send_ahead_once_built(spec, verify_task)
        return spec

    def discard(self) -> None:
        """Cancel the early Speculate: its outcome did not come, or the request ends."""
        early, self._pending = self._pending, None
        if early is not None:
            self._drop(early)

    def _drop(self, early: _Early) -> None:
        early.speculation.task.cancel()
        session = self._gen.draft_session
        session.sent = min(session.sent, early.base)  # the draft may hold the assumed tokens


def _likeliest(cache: draft_pb2.SpeculationCache, num_draft: int, acceptance: float):
    """The cache entry for the outcome the acceptance makes likeliest, if likely enough.

    k accepted has probability a^k (1 - a) for k < K and a^K for k = K (capped geometric): the
    likeliest is K or 0. Among its guesses the draft's first-ranked (entries keep rank order).
    """
    a = acceptance
    k, probability = (num_draft, a**num_draft) if a**num_draft >= 1 - a else (0, 1 - a)
    if probability < _EARLY_MIN_PROBABILITY:
        return None
    return next((entry for entry in cache.entries if entry.accepted == k), None)


_KNOWN_MISS = object()

# Why a round's cache lookup missed, on its span (`specd.round.miss`): the outcome was not among
# the guesses, the build was given up on, the Speculate call failed, or none was made for it.
MISS_UNCOVERED, MISS_LATE, MISS_FAILED, MISS_NO_SPECULATION = "uncovered", "late", "failed", "no_speculation"


def _miss_reason(cache) -> str:
    """What a miss of the round after this one is put down to, given what _collect returned."""
    if isinstance(cache, DraftFailed):
        return MISS_FAILED
    if cache is None:
        return MISS_LATE
    return MISS_UNCOVERED  # a hit never asks


async def _collect(
    speculation: _Speculation,
    outcome: tuple[int, int],
    config: CoordinatorConfig,
    verify_ms: float,
    draft: DraftLink,
    wait_s: float,
):
    """The speculation cache once built, or why not: _KNOWN_MISS, None (gave up), DraftFailed.

    The stream names the outcomes it covers after its first forward: an outcome not among them
    is a miss at once, and the build is cancelled (it stops between tree steps) so that the
    backup does not wait for it. For a covered outcome, with the jit backup the loop waits for
    the build (a Propose would queue behind it on the draft's one model thread anyway); with
    the ngram backup it waits only while the build may still end soon, then gives up.
    Whatever the backup, a draft that has not sent what the round waits for within `wait_s`
    is taken for hung (DraftFailed): the build is cancelled and the draft marked down.
    """
    hung_at = time.perf_counter() + wait_s
    if config.ssd_backup == "ngram" and config.ssd_wait_ms >= 0:
        deadline = time.perf_counter() + config.ssd_wait_ms / 1000.0
    else:
        # The build was sized to end inside a verification; allow it half a verification more.
        deadline = speculation.started + verify_ms * 1.5 / 1000.0
    spec_task, guesses = speculation.task, speculation.guesses
    if not guesses.done():
        await asyncio.wait({guesses, spec_task}, timeout=_left(hung_at), return_when=asyncio.FIRST_COMPLETED)
    if not guesses.done() and not spec_task.done():
        return _hung(spec_task, draft, wait_s)
    if guesses.done() and outcome not in guesses.result() and not spec_task.done():
        spec_task.cancel()
        return _KNOWN_MISS
    if not spec_task.done() and config.ssd_backup == "ngram":
        await asyncio.wait({spec_task}, timeout=_left(min(deadline, hung_at)))
        if not spec_task.done():
            spec_task.cancel()
            return None
    elif not spec_task.done():
        await asyncio.wait({spec_task}, timeout=_left(hung_at))
        if not spec_task.done():
            return _hung(spec_task, draft, wait_s)
    try:
        return await spec_task
    except DraftFailed as exc:
        return exc


def _left(until: float) -> float:
    """Seconds from now to `until` (time.perf_counter()), none if it has passed."""
    return max(0.0, until - time.perf_counter())


def _hung(spec_task: asyncio.Future, draft: DraftLink, wait_s: float) -> DraftFailed:
    """The round gave up on a draft that answered nothing in `wait_s`: cancel its build, mark it down."""
    spec_task.cancel()
    return DraftFailed(draft.timed_out(wait_s))
