"""Waiting for a target session: a target at its --max-sessions, or whose KV budget has no room for
the session's reservation (--kv-cache-bytes), refuses to open another.

Each coordinator sizes its admission from the workers' caps as if it were their only client, so
several coordinators on one worker pair admit more requests together than the target holds
sessions. A request whose first target call is refused for want of a session (RESOURCE_EXHAUSTED)
keeps its place and sends that call again once a session may have freed, instead of failing: at
once when a request of this coordinator ends its target session, else after a wait that grows
from FIRST_WAIT_S to LONGEST_WAIT_S (sessions other coordinators end are seen only so). Refused
requests ask again one at a time, in the order they were refused: the target refuses a call it
has no room for before the call's batch, but a crowd asking together would still load it with
calls beside the verifies of the requests it runs. The wait ends with the request (its deadline, a cancellation); requests
past the coordinator's places queue in admission meanwhile, and past --max-queued-requests are
refused there.

While the target refuses sessions (one refused within FULL_FOR_S), a new request opens its target
session first, on its own (TargetLink.open_session), and waits there: a request waiting for the
target then holds no draft session that the requests running on the target would lack.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import AsyncIterator

import grpc

from coordinator.workers import WorkerSession, no_session_room

FIRST_WAIT_S = 0.01
LONGEST_WAIT_S = 0.25
FULL_FOR_S = 2.0


def out_of_sessions(exc: grpc.aio.AioRpcError, session: WorkerSession) -> bool:
    """The worker refused to open `session` for want of room (workers.no_session_room); not a
    refusal of a session the worker had already opened (it lost it and is full now: the request
    fails as it would have)."""
    return no_session_room(exc) and not session.opened and not session.ended


class SessionWait:
    """Where requests refused a session wait, woken when a session of this coordinator ends."""

    def __init__(self) -> None:
        self._freed = asyncio.Event()
        self._turn = asyncio.Lock()  # wakes its waiters in the order they came
        self.waiting = 0  # refused requests now waiting for a session
        self.waits = 0  # waits so far (a request refused twice waits twice)
        self._refused_at = -FULL_FOR_S  # time.monotonic() of the latest refusal

    @property
    def full(self) -> bool:
        """The target refused a session lately: it may well refuse the next."""
        return time.monotonic() - self._refused_at < FULL_FOR_S

    def freed(self) -> None:
        """A request of this coordinator ended its session: every waiter tries again now."""
        freed, self._freed = self._freed, asyncio.Event()
        freed.set()

    @contextlib.asynccontextmanager
    async def turn(self) -> AsyncIterator[None]:
        """A refused request's turn to wait and ask again: one request at a time, in order."""
        self.waiting += 1
        self._refused_at = time.monotonic()
        try:
            async with self._turn:
                yield
        finally:
            self.waiting -= 1

    async def wait(self, most_s: float) -> None:
        """Until a session of this coordinator ends, or `most_s` passes."""
        self.waits += 1
        self._refused_at = time.monotonic()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(most_s):
                await self._freed.wait()
