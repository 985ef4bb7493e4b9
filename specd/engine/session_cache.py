"""Per-session KV caches that follow the coordinator's committed tokens.

A worker holds caches only. Each request names the committed history from some
absolute position on; the session joins it to the tokens it has cached, keeps the
longest common prefix (rolling back rejected draft tokens instead of recomputing
the prefix) and reports what still has to be fed to the model.

A session is opened with room reserved for the most tokens its request can reach; the store
admits it only while the reservations fit the worker's KV budget in bytes (KVBudget), or, when
the worker keeps its caches in a KV pool (specd/engine/kv_pool.py), while the pool has a free
range that large; beside its cap on the count of sessions.
"""

from __future__ import annotations

import dataclasses
import gc
import threading
import time

from transformers import DynamicCache

from specd.core.errors import SessionNotFound, SessionStale, TooManySessions
from specd.engine.kv_budget import KVBudget
from specd.engine.kv_cache import GrowingKVCache, croppable
from specd.engine.kv_pool import KVPool, KVRegion, PooledKVCache


@dataclasses.dataclass
class Session:
    cache: DynamicCache
    cached_tokens: list[int] = dataclasses.field(default_factory=list)  # ids whose KV is in `cache`
    last_used: float = dataclasses.field(default_factory=time.monotonic)
    reserve_tokens: int = 0  # the room its caches are made with (0: grown as written)

    @classmethod
    def reserved(cls, reserve_tokens: int, region: KVRegion | None = None) -> "Session":
        """A session with room for `reserve_tokens`: in `region` of the worker's KV pool, if it has one."""
        cache = PooledKVCache(region) if region is not None else GrowingKVCache(reserve_tokens)
        return cls(cache=cache, reserve_tokens=reserve_tokens)

    def new_cache(self) -> DynamicCache:
        """An empty cache with the session's room: in its cache's pool range (where a cache that
        outgrew its first range moved), or a growing one of its own."""
        if isinstance(self.cache, PooledKVCache):
            return PooledKVCache(self.cache.region)
        return GrowingKVCache(self.reserve_tokens)

    def held_tokens(self) -> int:
        """Tokens of KV room the session holds or has reserved, whichever is more."""
        held = self.cache.capacity_tokens() if isinstance(self.cache, GrowingKVCache | PooledKVCache) else self.cache.get_seq_length()
        return max(self.reserve_tokens, held)

    def sync(self, start: int, tokens: list[int]) -> tuple[list[int], list[int]]:
        """Join the committed tail to the cache; return (committed history, tokens to feed).

        The last committed token is always fed, so the forward yields the logits after it.
        """
        if start > len(self.cached_tokens):
            raise SessionStale(
                f"the request continues at position {start} but the session caches "
                f"{len(self.cached_tokens)} tokens; resend from position 0"
            )
        committed = self.cached_tokens[:start] + tokens
        if not committed:
            raise ValueError("no committed tokens")
        # Before `start` the history is the cache's own: only what follows can differ. (A scan of
        # the whole history cost a Python loop over every token of it, per call and session.)
        keep = start + _common_prefix(self.cached_tokens[start:], tokens)
        keep = min(keep, len(committed) - 1)
        self.rollback(keep)
        return committed, committed[keep:]

    def rollback(self, keep: int) -> None:
        """Drop cached tokens past `keep`."""
        drop = len(self.cached_tokens) - keep
        if drop <= 0:
            return
        if croppable(self.cache):
            self.cache.crop(-drop)  # transformers 5.x: a negative count of tokens to drop
        else:
            # Sliding-window or linear-attention layers cannot roll back: recompute.
            self.cache = self.new_cache()
            keep = 0
        del self.cached_tokens[keep:]

    def reset(self) -> None:
        """Forget everything cached (a forward failed part-way: no layer's entries can be trusted)."""
        self.cache = self.new_cache()
        self.cached_tokens = []

    def extend(self, tokens: list[int]) -> None:
        """Record that a forward put `tokens` into the cache."""
        self.cached_tokens.extend(tokens)


_COLLECT_EVERY_S = 1.0
_last_collect = [0.0]  # when a refusal last collected garbage


def _allocate(pool: KVPool, tokens: int) -> KVRegion:
    """A range of `pool` for `tokens`; before refusing, once more after collecting garbage (a
    finished session's range returns when its cache is freed, which a reference cycle can delay),
    at most once a second: a full pool refuses often."""
    try:
        return pool.allocate(tokens)
    except TooManySessions:
        if time.monotonic() - _last_collect[0] < _COLLECT_EVERY_S:
            raise
        _last_collect[0] = time.monotonic()
        gc.collect()
        return pool.allocate(tokens)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    for i in range(n):
        if a[i] != b[i]:
            return i
    return n


class SessionStore:
    """Sessions by id, with an idle timeout, a cap on their count and, with a KVBudget or a KV
    pool, on the KV room they hold; safe to call from any thread."""

    def __init__(self, max_sessions: int, idle_timeout_s: float, kv_budget: KVBudget | None = None, pool: KVPool | None = None):
        self._sessions: dict[str, Session] = {}
        self._lock = threading.Lock()
        self._max_sessions = max_sessions
        self._idle_timeout_s = idle_timeout_s
        self.kv_budget = kv_budget or KVBudget()
        self.pool = pool  # where the sessions' caches live; None: each its own

    def open(self, session_id: str, start: int, reserve_tokens: int = 0) -> Session:
        """The session to continue; a new one, with room for `reserve_tokens` (clamped to the
        budget's most), when the request starts at position 0."""
        with self._lock:
            session = self._sessions.get(session_id)
            if session is None:
                if start != 0:
                    raise SessionNotFound(
                        f"session {session_id!r} is not on this worker; resend from position 0"
                    )
                self._check_count()
                reserve_tokens = self.kv_budget.clamp(reserve_tokens)
                if self.pool is not None:
                    session = Session.reserved(reserve_tokens, _allocate(self.pool, reserve_tokens))
                else:
                    self.kv_budget.admit(reserve_tokens, self._held_tokens)
                    session = Session.reserved(reserve_tokens)
                self._sessions[session_id] = session
            session.last_used = time.monotonic()
            return session

    def check_admits(self, session_id: str, start: int, reserve_tokens: int = 0) -> None:
        """TooManySessions now where `open` would refuse to open this session now, so that a call
        refused for want of room is told at once instead of waiting for its place in a forward
        (`open` still decides: room may free, or be taken, in between)."""
        if start != 0 or session_id in self._sessions:  # most calls: no lock taken on the caller's thread
            return
        with self._lock:
            self._check_count()
            reserve_tokens = self.kv_budget.clamp(reserve_tokens)
            if self.pool is None:
                self.kv_budget.admit(reserve_tokens, self._held_tokens)
            elif time.monotonic() - _last_collect[0] < _COLLECT_EVERY_S:  # else `open` collects garbage first
                self.pool.check_room(reserve_tokens)

    def _check_count(self) -> None:
        if len(self._sessions) >= self._max_sessions:
            raise TooManySessions(f"this worker holds its maximum of {self._max_sessions} sessions; retry later")

    def _held_tokens(self) -> int:
        return sum(session.held_tokens() for session in self._sessions.values())

    def held_bytes(self) -> int:
        """KV bytes the sessions hold or have reserved (what the budget counts); with a pool, the
        bytes of its taken ranges."""
        if self.pool is not None:
            return self.pool.used_tokens() * self.pool.bytes_per_token
        with self._lock:
            return self.kv_budget.bytes_for(self._held_tokens())

    @property
    def max_sessions(self) -> int:
        return self._max_sessions

    def end(self, session_id: str) -> bool:
        with self._lock:
            return self._sessions.pop(session_id, None) is not None

    def expire_idle(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            expired = [sid for sid, s in self._sessions.items() if now - s.last_used > self._idle_timeout_s]
            for sid in expired:
                del self._sessions[sid]
        return expired

    def __len__(self) -> int:
        return len(self._sessions)

    def __contains__(self, session_id: str) -> bool:
        with self._lock:
            return session_id in self._sessions
