"""Each session's latest verify outcome, for the verifies sent ahead (VerifyAfter) to wait on.

A verify is named by its session and the committed tokens it was sent (start + tail); its
outcome is (k accepted, next token t*). Lives on the event loop: no locks.
"""

from __future__ import annotations

import asyncio
import collections

Outcome = tuple[int, int]  # (k, t*)


class VerifyOutcomes:
    def __init__(self, capacity: int = 4096):
        self._capacity = capacity  # sessions remembered; the oldest are forgotten first
        self._latest: collections.OrderedDict[str, tuple[int, Outcome]] = collections.OrderedDict()
        self._waiters: dict[str, list[tuple[int, asyncio.Future]]] = {}

    def record(self, session_id: str, committed: int, outcome: Outcome) -> None:
        """The session's verify of `committed` tokens finished with `outcome`."""
        self._latest[session_id] = (committed, outcome)
        self._latest.move_to_end(session_id)
        while len(self._latest) > self._capacity:
            self._latest.popitem(last=False)
        for length, waiter in self._waiters.get(session_id, []):
            if length <= committed and not waiter.done():
                # A later verify than the one waited for means that one will not come.
                waiter.set_result(outcome if length == committed else None)

    async def wait(self, session_id: str, committed: int) -> Outcome | None:
        """The outcome of the session's verify of `committed` tokens, once it has finished;
        None if the session has moved past it or ended."""
        latest = self._latest.get(session_id)
        if latest is not None and latest[0] >= committed:
            return latest[1] if latest[0] == committed else None
        waiter = asyncio.get_running_loop().create_future()
        entry = (committed, waiter)
        self._waiters.setdefault(session_id, []).append(entry)
        try:
            return await waiter
        finally:
            waiters = self._waiters[session_id]
            waiters.remove(entry)
            if not waiters:
                del self._waiters[session_id]

    def forget(self, session_id: str) -> None:
        """The session ended: nothing more will be verified in it."""
        self._latest.pop(session_id, None)
        for _, waiter in self._waiters.get(session_id, []):
            if not waiter.done():
                waiter.set_result(None)
