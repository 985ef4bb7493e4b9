"""Calls of different sessions that are ready at the same moment run as one batch.

A worker's forwards run one at a time on its model thread. While one runs, the calls that
arrive wait here; at its next turn (specd/engine/turns.py: at once, or after a brief wait for the
sessions of the last forwards) the model thread takes all of them, up to a cap and at most one
per session (a session's calls depend on each other), and runs them as one batch: a lone call
runs at once, as before batching, and a loaded worker's batches grow with its load (continuous
batching).

`run_batch(items)` runs on the model thread and returns one result per item: a value, the
exception that item raised (one bad call fails alone), or AGAIN: the item made progress but is
not done (a long prompt's prefill catches up a chunk per shared forward), and it stays first in
line for the next batch.
"""

from __future__ import annotations

import collections
import concurrent.futures
import threading
import time
from typing import Callable, Hashable

from specd.core.errors import SessionNotFound, no_stop_iteration
from specd.engine.turns import Pending, Turns


class Again:
    """run_batch's result for an item that is not done: run it again in the next batch."""

    def __reduce__(self):  # one instance, also across a tensor-parallel group's pickles
        return "AGAIN"


AGAIN = Again()


def _fail(future: concurrent.futures.Future, exc: BaseException) -> None:
    """Fail a future that is queued, or already running (an item run AGAIN)."""
    if future.running() or future.set_running_or_notify_cancel():
        future.set_exception(exc)


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
        self._run_batch = run_batch
        self._session_of = session_of
        self._max_batch = max_batch
        self._lock = threading.Lock()
        self._pending: collections.deque[tuple[concurrent.futures.Future, object]] = collections.deque()
        self._in_forward: set[Hashable] = set()  # sessions of the batch running now
        self._ended_in_forward: set[Hashable] = set()  # of those, the ones forgotten meanwhile
        self._turns = Turns(submit, self._drain, self._pending_sessions, self._refuse, max_batch, max_wait_s)

    def enqueue(self, future: concurrent.futures.Future, item: object) -> None:
        """Run `item` in the next batch and resolve `future` with its result (from any thread,
        the model thread included). A future cancelled before its batch forms is not run."""
        with self._lock:
            self._pending.append((future, item))
        self._turns.poke()

    def submit(self, item: object) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self.enqueue(future, item)
        return future

    def _pending_sessions(self) -> Pending:
        with self._lock:
            return {self._session_of(item) for _, item in self._pending}, False

    def _refuse(self, exc: BaseException) -> None:
        with self._lock:
            failed, self._pending = list(self._pending), collections.deque()
        for future, _ in failed:
            _fail(future, exc)

    def _drain(self) -> None:
        """On the model thread: one batch of what is pending."""
        batch, forward_s = [], None
        try:
            batch = self._take()
            if batch:
                started = time.perf_counter()
                self._run(batch)
                forward_s = time.perf_counter() - started
        finally:  # the next turn is never lost
            self._turns.done([self._session_of(item) for _, item in batch], forward_s)

    def forget(self, session: Hashable) -> None:
        """The session ended (EndSession): its calls still pending are cancelled, since running
        them would only open the session again, to be held until the idle timeout; and the
        next batches do not wait for it."""
        with self._lock:
            dropped = [entry for entry in self._pending if self._session_of(entry[1]) == session]
            self._pending = collections.deque(entry for entry in self._pending if self._session_of(entry[1]) != session)
            if session in self._in_forward:
                self._ended_in_forward.add(session)  # a call of it that comes back AGAIN ends there
        for future, _ in dropped:
            if not future.cancel():  # an item run AGAIN is running: its call ends here
                _fail(future, SessionNotFound(f"session {session!r} ended"))
        self._turns.forget(session)

    def _take(self) -> list[tuple[concurrent.futures.Future, object]]:
        """The oldest pending calls, one per session, up to the cap; cancelled ones dropped."""
        batch, sessions, deferred = [], set(), collections.deque()
        with self._lock:
            while self._pending and len(batch) < self._max_batch:
                future, item = self._pending.popleft()
                session = self._session_of(item)
                if session in sessions:
                    deferred.append((future, item))  # after this one's batch, in order
                elif future.running() or future.set_running_or_notify_cancel():  # running: an item run AGAIN
                    batch.append((future, item))
                    sessions.add(session)
            self._pending.extendleft(reversed(deferred))
            self._in_forward = sessions
        return batch

    def _run(self, batch: list[tuple[concurrent.futures.Future, object]]) -> None:
        try:
            results = no_stop_iteration(self._run_batch, [item for _, item in batch])
        except BaseException as exc:  # noqa: BLE001 - every call of the batch reports it
            results = [exc] * len(batch)
        with self._lock:
            ended, self._in_forward, self._ended_in_forward = self._ended_in_forward, set(), set()
        again = collections.deque()
        for (future, item), result in zip(batch, results):
            if isinstance(result, Again) and self._session_of(item) in ended:
                future.set_exception(SessionNotFound(f"session {self._session_of(item)!r} ended"))
            elif isinstance(result, Again):
                again.append((future, item))
            elif isinstance(result, BaseException):
                future.set_exception(result)
            else:
                future.set_result(result)
        if again:
            with self._lock:
                self._pending.extendleft(reversed(again))  # first in line, in order
