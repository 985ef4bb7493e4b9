"""When a worker's model thread takes its next turn at the calls pending for it.

A turn is one forward over what is pending (specd/engine/batcher.py, specd/engine/step_batcher.py). A call
that finds the thread idle gets a turn at once: a lone request runs as it did before batching.
Left at that, batches fragment: when a batch's answers go out, the first of its sessions to
send its next call finds the thread idle and runs alone, and the rest queue behind that
forward, so every round costs two forwards; two sessions even lock into turns, each one's call
arriving while the other's forward runs (measured: off at 2 streams no faster than at 1). So
while a session served by the last two forwards has not sent its next call, the next turn
waits for it, at most `max_wait_s` and a quarter of the last forward past that forward's end.
It waits on a timer, not on the model thread, which stays free for other work (a session's
EndSession, a draft Prefill). An ended session (`forget`) is not waited for.
"""

from __future__ import annotations

import threading
import time
from typing import Callable, Hashable

# What the owner has pending: the sessions of its pending calls, and whether a turn must run
# now whatever the wait says (jobs already under way).
Pending = tuple[set, bool]


class Turns:
    """`submit(fn)` queues `fn` on the model thread; `turn()` is the owner's turn, which ends
    by calling `done`; `pending()` reads the owner's queue; `refused(exc)` fails the owner's
    pending calls when the model thread takes no more work."""

    def __init__(
        self,
        submit: Callable,
        turn: Callable[[], None],
        pending: Callable[[], Pending],
        refused: Callable[[BaseException], None],
        max_batch: int,
        max_wait_s: float,
    ):
        self._submit, self._turn, self._pending, self._refused = submit, turn, pending, refused
        self._max_batch = max_batch
        self._max_wait_s = max_wait_s
        self._lock = threading.Lock()
        self._scheduled = False  # a turn is queued on the model thread or running
        self._timer: threading.Timer | None = None
        self._forwards = 0
        self._last_seen: dict[Hashable, int] = {}  # session -> the forward that last served it
        self._last_forward_s = 0.0
        self._last_end = 0.0  # time.monotonic() when the last forward ended

    def poke(self) -> None:
        """Something was queued: take a turn now, after the wait, or leave it to the turn under way."""
        with self._lock:
            if self._scheduled:
                return
            wait = self._wait_left()
            if wait is None:
                return
            if wait > 0:
                if self._timer is None:
                    self._timer = threading.Timer(wait, self._timer_fired)
                    self._timer.daemon = True
                    self._timer.start()
                return
            self._take_turn_locked()
        self._submit_turn()

    def done(self, served: list[Hashable], forward_s: float | None) -> None:
        """The turn ended, having served these sessions in a forward of `forward_s` (None: no forward)."""
        with self._lock:
            if forward_s is not None:
                self._forwards += 1
                self._last_forward_s, self._last_end = forward_s, time.monotonic()
                for session in served:
                    self._last_seen[session] = self._forwards
                self._last_seen = {s: n for s, n in self._last_seen.items() if n >= self._forwards - 1}
            self._scheduled = False
        self.poke()

    def forget(self, session: Hashable) -> None:
        with self._lock:
            self._last_seen.pop(session, None)
        self.poke()  # a turn that waited for it need not

    def _wait_left(self) -> float | None:
        """Seconds the next turn should still wait; None when nothing is pending."""
        sessions, must_run = self._pending()
        if must_run:
            return 0.0
        if not sessions:
            return None
        expected = min(len(self._last_seen), self._max_batch)
        if expected <= 1 or len(sessions & self._last_seen.keys()) >= expected or len(sessions) >= self._max_batch:
            return 0.0
        deadline = self._last_end + min(self._max_wait_s, self._last_forward_s / 4)
        return max(0.0, deadline - time.monotonic())

    def _take_turn_locked(self) -> None:
        self._scheduled = True
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _timer_fired(self) -> None:
        with self._lock:
            self._timer = None
            if self._scheduled:
                return
            self._take_turn_locked()
        self._submit_turn()

    def _submit_turn(self) -> None:
        try:
            self._submit(self._turn)
        except RuntimeError as exc:  # the model thread is shutting down: calls fail, not hang
            with self._lock:
                self._scheduled = False
            self._refused(exc)
