"""Calls of different sessions that are ready at the same moment run as one batch.

A worker's forwards run one at a time on its model thread. While one runs, the calls that
arrive wait here; when the model thread comes back it takes all of them (up to a cap, at most
one per session: a session's calls depend on each other) and runs them as one batch: a lone
call runs at once, as it did before batching, and a loaded worker's batches grow by themselves
with its load (continuous batching).

Left at that, batches fragment: when a batch's answers go out, the first of its sessions to
send its next call finds the model thread idle and runs alone, and the rest queue behind that
forward, so every round costs two forwards; two sessions even lock into turns, each one's
call arriving while the other's forward runs. So a batch waits, at most `max_wait_s` and a
quarter of the last forward's time, until every session served in the last two forwards has
a call pending (`RecentSessions`); an ended session (`forget`) is not waited for.

`run_batch(items)` runs on the model thread and returns one result per item: a value, or the
exception that item raised (one bad call fails alone).
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Callable, Hashable

from specd.serving import no_stop_iteration


class RecentSessions:
    """The sessions of the last two forwards, and the brief wait for their next calls."""

    def __init__(self, max_wait_s: float, max_batch: int):
        self._max_wait_s = max_wait_s
        self._max_batch = max_batch
        self._forwards = 0
        self._last_seen: dict[Hashable, int] = {}  # session -> the forward that last served it
        self._last_forward_s = 0.0

    def served(self, sessions: list[Hashable], forward_s: float) -> None:
        self._forwards += 1
        self._last_forward_s = forward_s
        for session in sessions:
            self._last_seen[session] = self._forwards
        self._last_seen = {s: n for s, n in self._last_seen.items() if n >= self._forwards - 1}

    def forget(self, session: Hashable) -> None:
        self._last_seen.pop(session, None)

    def wait(self, lock: threading.Condition, pending: Callable[[], set]) -> None:
        """With `lock` free, wait on it until `pending()` holds every recent session, within the bound."""
        expected = min(len(self._last_seen), self._max_batch)
        wait = min(self._max_wait_s, self._last_forward_s / 4)
        if expected <= 1 or wait <= 0:
            return
        deadline = time.monotonic() + wait
        with lock:
            while len(pending() & self._last_seen.keys()) < expected and len(pending()) < self._max_batch:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return
                lock.wait(remaining)


class Batcher:
    """`submit(fn)` queues work on the model thread; `session_of(item)` names an item's session."""

    def __init__(
        self,
        submit: Callable,
        run_batch: Callable[[list], list],
        session_of: Callable[[object], Hashable],
        max_batch: int,
        max_wait_s: float = 0.0,
    ):
        self._submit = submit
        self._run_batch = run_batch
        self._session_of = session_of
        self._max_batch = max_batch
        self._recent = RecentSessions(max_wait_s, max_batch)
        self._lock = threading.Condition()
        self._pending: collections.deque[tuple[concurrent.futures.Future, object]] = collections.deque()
        self._scheduled = False  # a drain is queued on the model thread, or running

    def enqueue(self, future: concurrent.futures.Future, item: object) -> None:
        """Run `item` in the next batch and resolve `future` with its result (from any thread,
        the model thread included). A future cancelled before its batch forms is not run."""
        with self._lock:
            self._pending.append((future, item))
            start = not self._scheduled
            self._scheduled = True
            self._lock.notify()
        if start:
            self._schedule()

    def submit(self, item: object) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.enqueue(future, item)
        return future

    def _schedule(self) -> None:
        try:
            self._submit(self._drain)
        except RuntimeError as exc:  # the model thread is shutting down: the calls fail, not hang
            with self._lock:
                failed, self._pending = list(self._pending), collections.deque()
                self._scheduled = False
            for future, _ in failed:
                if future.set_running_or_notify_cancel():
                    future.set_exception(exc)

    def _drain(self) -> None:
        """On the model thread: one batch of what is pending, then another drain if more came."""
        self._recent.wait(self._lock, lambda: {self._session_of(item) for _, item in self._pending})
        batch = self._take()
        if batch:
            started = time.perf_counter()
            self._run(batch)
            with self._lock:
                self._recent.served([self._session_of(item) for _, item in batch], time.perf_counter() - started)
        with self._lock:
            again = bool(self._pending)
            self._scheduled = again
        if again:
            self._schedule()

    def forget(self, session: Hashable) -> None:
        """The session ended: the next batches do not wait for it."""
        with self._lock:
            self._recent.forget(session)

    def _take(self) -> list[tuple[concurrent.futures.Future, object]]:
        """The oldest pending calls, one per session, up to the cap; cancelled ones dropped."""
        batch, sessions, deferred = [], set(), collections.deque()
        with self._lock:
            while self._pending and len(batch) < self._max_batch:
                future, item = self._pending.popleft()
                session = self._session_of(item)
                if session in sessions:
                    deferred.append((future, item))  # after this one's batch, in order
                elif future.set_running_or_notify_cancel():
                    batch.append((future, item))
                    sessions.add(session)
            self._pending.extendleft(reversed(deferred))
        return batch

    def _run(self, batch: list[tuple[concurrent.futures.Future, object]]) -> None:
        try:
            results = no_stop_iteration(self._run_batch, [item for _, item in batch])
        except BaseException as exc:  # noqa: BLE001 - every call of the batch reports it
            results = [exc] * len(batch)
        for (future, _), result in zip(batch, results):
            if isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
