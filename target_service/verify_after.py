"""Each session's latest verify outcome, and the verifies sent ahead (VerifyAfter) waiting on it.

A verify is named by its session and the committed tokens it was sent (start + tail); its
outcome is (k accepted, next token t*), the key the coordinator's speculation cache uses too
(specd/core/outcomes.py). The model thread records an outcome right after its
forward and, when a verify sent ahead holds a choice for that outcome, queues that choice for
the model thread's next batch itself: the next forward starts without a turn of the event
loop, which on a busy machine waits for a core (the event loop learns of it when the answer
is ready).
Recorded from the model thread, waited on from the event loop: a lock guards both.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import threading
from typing import Callable

from specd.core.outcomes import Outcome


@dataclasses.dataclass
class Waiter:
    """A verify sent ahead: its choices by outcome, and the answer the event loop awaits."""

    committed: int  # the verify it follows left this many committed tokens
    choices: dict[Outcome, object]  # outcome -> what `run_choice` takes for it
    answer: concurrent.futures.Future  # -> run_choice's result, or None when nothing ran


class VerifyOutcomes:
    """`enqueue(future, choice)` queues a chosen verify for the model thread (specd/engine/batcher.py),
    which resolves `future` with its result, or skips it when `future` was cancelled first."""

    def __init__(self, enqueue: Callable, capacity: int = 4096):
        self._enqueue = enqueue
        self._capacity = capacity  # sessions remembered; the oldest are forgotten first
        self._lock = threading.Lock()
        self._latest: collections.OrderedDict[str, tuple[int, Outcome]] = collections.OrderedDict()
        self._waiters: dict[str, list[Waiter]] = {}

    def record(self, session_id: str, committed: int, outcome: Outcome) -> None:
        """The session's verify of `committed` tokens finished with `outcome` (model thread)."""
        with self._lock:
            self._latest[session_id] = (committed, outcome)
            self._latest.move_to_end(session_id)
            while len(self._latest) > self._capacity:
                self._latest.popitem(last=False)
            waiters = self._waiters.get(session_id, [])
            # A later verify than the one waited for means that one will not come.
            settled = [w for w in waiters if w.committed <= committed]
            if settled:
                self._waiters[session_id] = [w for w in waiters if w.committed > committed]
                if not self._waiters[session_id]:
                    del self._waiters[session_id]
        for waiter in settled:
            self._settle(waiter, outcome if waiter.committed == committed else None)

    def expect(self, session_id: str, committed: int, choices: dict[Outcome, object]) -> Waiter:
        """A verify sent ahead to follow the session's verify of `committed` tokens (event loop).

        Its answer is the chosen verify's result once run, or None when its outcome has no
        choice, the session moved past that verify, or ended.
        """
        waiter = Waiter(committed, choices, concurrent.futures.Future())
        with self._lock:
            latest = self._latest.get(session_id)
            if latest is None or latest[0] < committed:
                self._waiters.setdefault(session_id, []).append(waiter)
                return waiter
        self._settle(waiter, latest[1] if latest[0] == committed else None)
        return waiter

    def knows(self, session_id: str) -> bool:
        """Whether a verify of the session has been recorded (and the session not forgotten)."""
        with self._lock:
            return session_id in self._latest

    def discard(self, session_id: str, waiter: Waiter) -> None:
        """The caller gave up on `waiter` (a cancelled call): its choice is not run."""
        with self._lock:
            waiters = self._waiters.get(session_id, [])
            if waiter in waiters:
                waiters.remove(waiter)
                if not waiters:
                    del self._waiters[session_id]
        waiter.answer.cancel()

    def forget(self, session_id: str) -> None:
        """The session ended: nothing more will be verified in it."""
        with self._lock:
            self._latest.pop(session_id, None)
            waiters = self._waiters.pop(session_id, [])
        for waiter in waiters:
            _resolve(waiter.answer, None)

    def _settle(self, waiter: Waiter, outcome: Outcome | None) -> None:
        choice = waiter.choices.get(outcome) if outcome is not None else None
        if choice is None:
            _resolve(waiter.answer, None)
            return
        try:
            self._enqueue(waiter.answer, choice)
        except RuntimeError as exc:  # the model thread is shutting down: the call fails, not hangs
            if waiter.answer.set_running_or_notify_cancel():
                waiter.answer.set_exception(exc)


def _resolve(answer: concurrent.futures.Future, value) -> None:
    """Set `answer` unless its caller has cancelled it already."""
    if answer.set_running_or_notify_cancel():
        answer.set_result(value)
