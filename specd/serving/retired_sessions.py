"""Session ids an EndSession retired, remembered for a while so that their late calls are refused.

When a request ends, the coordinator cancels its calls still under way and ends its sessions.
A call it sent just before (a Propose, a Verify from position 0) can still reach the worker
after the EndSession: the client's cancel does not overtake it, and the server runs the calls
of one connection in no fixed order. Run, it would open the session again, to be held until
the idle timeout. So an EndSession that says `retire_id` (the caller never uses the id again)
leaves the id here, and calls for it are answered NOT_FOUND while it is remembered.

Only a retired id is remembered: a caller may end a session and open one under the same id
again, and a session the worker dropped for idleness (or lost in a restart) is resent by the
coordinator from position 0 under its id, which must open it.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Callable

from specd.core.errors import SessionNotFound


class RetiredSessions:
    """Ids retired in the last `memory_s` seconds; safe to call from any thread."""

    def __init__(self, memory_s: float, clock: Callable[[], float] = time.monotonic):
        self._memory_s = memory_s
        self._clock = clock
        self._retired: collections.OrderedDict[str, float] = collections.OrderedDict()  # id -> when, oldest first
        self._lock = threading.Lock()

    def add(self, session_id: str) -> None:
        """The id was retired: refuse calls for it for the next `memory_s` seconds."""
        with self._lock:
            now = self._clock()
            self._forget_older_than(now - self._memory_s)
            self._retired[session_id] = now
            self._retired.move_to_end(session_id)

    def check(self, session_id: str) -> None:
        """SessionNotFound (NOT_FOUND) if the id was retired within the memory."""
        with self._lock:
            now = self._clock()
            self._forget_older_than(now - self._memory_s)
            retired_at = self._retired.get(session_id)
        if retired_at is not None:
            raise SessionNotFound(
                f"session {session_id!r} was ended for good (EndSession with retire_id) {now - retired_at:.1f} s ago; "
                f"this worker refuses calls for it for {self._memory_s:g} s: a new session needs a new id"
            )

    def __len__(self) -> int:
        with self._lock:
            return len(self._retired)

    def _forget_older_than(self, cutoff: float) -> None:
        while self._retired:
            session_id, retired_at = next(iter(self._retired.items()))
            if retired_at > cutoff:
                return
            del self._retired[session_id]
