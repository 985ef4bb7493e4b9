"""The target model runner: sessions and forwards, with no gRPC in it.

The servicer calls these methods from one executor thread. A tensor-parallel
runner offers the same methods: rank 0 broadcasts each call and every rank runs it.
Verifies and prompt prefills of different sessions that are ready together run as one
packed forward (specd/engine/packed_forward.py); then each verify is decided
(target_service/verify_decision.py: the plain greedy ones together, from one read-back).
In a forward shared with other sessions, a call that still has to cache a long stretch of
committed tokens (a new prompt) caches at most `prefill_chunk` of them and runs again in the
next batch (AGAIN), so that one long prompt does not make everyone's step as slow as its
prefill. A batch may also come with a limit on the tokens its forward feeds (the time budget
of target_service/prefill_pacing.py): catch-ups are then cut, alone or shared, so that the
forward feeds about that many, the shorter feeds whole first and the rest shared evenly.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import torch

from specd.core.tokenizer_spec import TokenizerSpec
from specd.engine.batcher import AGAIN, Again
from specd.engine.forward import forward_logits
from specd.engine.kv_pool import make_room
from specd.engine.loading import LoadedModel
from specd.engine.packed_forward import Segment, enable_packing, graphs_fit, packing_fast_paths
from specd.engine.session_cache import Session, SessionStore
from target_service.calls import Call, PrefillCall, Prefilled
from target_service.verify_decision import Verified, VerifyOutcome, decide_all

MIN_CHUNK = 16  # fewest catch-up tokens a cut call caches per forward, however full the forward: it must progress


class ForwardCost(NamedTuple):
    """What one forward fed and took."""

    fed_tokens: int  # every session's, draft tokens included
    committed_tokens: int  # of those, committed ones (a verify's last one, catch-ups)
    ms: float


@dataclasses.dataclass(frozen=True)
class _Synced:
    """A call joined to its session: what the forward feeds, the logits kept, where d_1 sits."""

    call: Call
    session: Session
    feed: list[int]  # verify: uncached committed tokens (at least the last), then d_1..d_K
    num_logits: int
    first_position: int  # absolute position of d_1 (of the token after the committed ones)

    @property
    def committed_feed(self) -> int:
        """Committed tokens this call feeds (its catch-up), drafts not counted: a whole verify keeps
        a logit after its last committed token and each draft; a prefill or a chunk feeds no draft."""
        return len(self.feed) - (self.num_logits - 1)

    def verified(self, logits: torch.Tensor) -> Verified:
        """This verify's decision's inputs after its forward: its logits [K+1, V]."""
        # The committed tokens, for a repetition penalty: the cache holds them all by now.
        history = self.session.cached_tokens[: self.first_position] if self.call.sampling.penalizes else []
        return Verified(self.call, logits, history, self.first_position, len(self.session.cached_tokens))

    def first_chunk(self, most: int) -> _Synced | None:
        """The first `most` tokens of a catch-up longer than that, to cache now (the call runs
        again for the rest); None when the committed tokens to feed are `most` or fewer."""
        if self.committed_feed <= most:
            return None
        return _Synced(self.call, self.session, self.feed[:most], 1, self.first_position)


class TargetModelRunner:
    def __init__(
        self, loaded: LoadedModel, sessions: SessionStore, pack: bool = True, prefill_chunk: int = 0, backend: str = "cpu",
        fast_paths: tuple[str, ...] = (), tokenizer_spec: TokenizerSpec | None = None, cuda_graphs: bool = False,
    ):
        self.loaded = loaded
        self.tokenizer_spec = tokenizer_spec  # what the coordinator tokenises with (its Info); None: not exportable
        self.sessions = sessions
        # None: one session per forward
        self._packer = enable_packing(loaded.model, sessions.pool, graphs_fit(cuda_graphs, loaded.model)) if pack else None
        self.backend = backend  # the device backend the model runs on, and the fast paths it took at load
        self._loaded_fast_paths = fast_paths
        self._prefill_chunk = prefill_chunk  # in a shared forward, most committed tokens a call caches (0: all)
        self.last_forward: ForwardCost | None = None  # of run_batch's forward, if it ran one

    @property
    def fast_paths(self) -> tuple[str, ...]:
        """The fast paths the model's forwards take now (CUDA graphs may have turned off since load)."""
        return self._loaded_fast_paths + packing_fast_paths(self._packer, self.sessions.pool)

    def run_batch(self, calls: list[Call], most_tokens: int | None = None) -> list[VerifyOutcome | Prefilled | Again | BaseException]:
        """Verifies and prefills of different sessions in one forward; each call's outcome
        (a VerifyOutcome, or a prefill's (cached, ms)), AGAIN for a call that cached a chunk of
        its catch-up and runs again, or what it raised. With `most_tokens`, catch-ups are cut so
        that the forward feeds about that many tokens."""
        self.last_forward = None
        if len(calls) == 1 or self._packer is None:
            return [_outcome_or_error(self._run_one, call, most_tokens) for call in calls]
        results: dict[int, VerifyOutcome | Prefilled | Again | BaseException] = {}
        synced: dict[int, _Synced] = {}
        for i, call in enumerate(calls):
            try:
                synced[i] = self._sync(call)
            except Exception as exc:  # noqa: BLE001 - this call alone fails
                results[i] = exc
        for i in [i for i, joined in synced.items() if not joined.feed]:  # a prefill with nothing to cache
            results[i] = (len(synced.pop(i).session.cached_tokens), 0.0)
        chunked = self._chunk_catch_ups(synced, most_tokens)
        if synced:
            logits, forward_ms = self._forward(list(synced.values()))  # [num_logits, V] each
            verified = {}
            for (i, joined), call_logits in zip(synced.items(), logits):
                if i in chunked:
                    results[i] = AGAIN
                elif isinstance(joined.call, PrefillCall):
                    results[i] = (len(joined.session.cached_tokens), forward_ms)
                else:
                    verified[i] = joined.verified(call_logits)
            results.update(zip(verified, decide_all(list(verified.values()), forward_ms)))
        return [results[i] for i in range(len(calls))]

    def _chunk_catch_ups(self, synced: dict[int, _Synced], most_tokens: int | None) -> set[int]:
        """Long catch-ups cut to their first chunk (in place); their indices. In a shared forward
        a catch-up caches at most `prefill_chunk` tokens; with `most_tokens`, the calls feeding
        least are counted whole first and each longer catch-up gets an even share of what is
        left, at least MIN_CHUNK tokens."""
        each = self._prefill_chunk if len(synced) > 1 and self._prefill_chunk else None
        room = most_tokens
        if each is None and room is None:  # nothing to cut by: no sort on the forward's way
            return set()
        chunked = set()
        by_catch_up = sorted(synced, key=lambda i: synced[i].committed_feed)  # stable: the same order on every rank
        for calls_left, i in zip(range(len(by_catch_up), 0, -1), by_catch_up):
            most = each
            if room is not None:
                share = max(MIN_CHUNK, room // calls_left)
                most = share if most is None else min(most, share)
            chunk = synced[i].first_chunk(most) if most is not None else None
            if chunk is not None:
                synced[i] = chunk
                chunked.add(i)
            if room is not None:
                room -= len(synced[i].feed)
        return chunked

    def _run_one(self, call: Call, most_tokens: int | None) -> VerifyOutcome | Prefilled | Again:
        """One call in a forward of its own: cut to `most_tokens` if its catch-up is longer."""
        joined = self._sync(call)
        if not joined.feed:  # a prefill with nothing to cache
            return len(joined.session.cached_tokens), 0.0
        chunk = joined.first_chunk(most_tokens) if most_tokens is not None else None
        (logits,), forward_ms = self._forward([chunk or joined])  # [num_logits, V]
        if chunk is not None:
            return AGAIN
        if isinstance(call, PrefillCall):
            return len(joined.session.cached_tokens), forward_ms
        return decide_all([joined.verified(logits)], forward_ms)[0]

    def _sync(self, call: Call) -> _Synced:
        session = self.sessions.open(call.session_id, call.start, call.reserve_tokens)
        committed, feed = session.sync(call.start, call.tokens)
        if isinstance(call, PrefillCall):
            synced = _Synced(call, session, feed[:-1], 1, len(committed))
        else:
            synced = _Synced(call, session, feed + call.draft_tokens, call.num_draft + 1, len(committed))
        make_room(session.cache, len(synced.feed))  # before a shared forward: a call without room fails alone
        return synced

    def _forward(self, batch: list[_Synced]) -> tuple[list[torch.Tensor], float]:
        """Each call's last `num_logits` logits ([num_logits, V] each) and the forward's ms."""
        try:
            if len(batch) == 1 and not (self._packer is not None and self._packer.pooled):  # one over the pool: a graph
                one = batch[0]
                logits, forward_ms = forward_logits(self.loaded.model, one.session.cache, one.feed, one.num_logits)
                logits = [logits]
            else:
                segments = [Segment(b.session.cache, b.feed, b.num_logits) for b in batch]
                logits, forward_ms = self._packer.forward(segments)
        except BaseException:
            for b in batch:
                b.session.reset()
            raise
        for b in batch:
            b.session.extend(b.feed)
        self.last_forward = ForwardCost(sum(len(b.feed) for b in batch), sum(b.committed_feed for b in batch), forward_ms)
        return logits, forward_ms

    def end_session(self, session_id: str) -> bool:
        return self.sessions.end(session_id)

    def expire_idle(self) -> list[str]:
        return self.sessions.expire_idle()


def _outcome_or_error(run, *args) -> VerifyOutcome | Prefilled | Again | BaseException:
    try:
        return run(*args)
    except Exception as exc:  # noqa: BLE001 - this call alone fails
        return exc
