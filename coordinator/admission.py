"""Admission control: at most N requests run at once, a bounded FIFO queue waits behind them,
and a request past both is refused at once with RESOURCE_EXHAUSTED.

A request's place is held until its worker sessions are ended (or their EndSession has failed
or timed out), not only until its last token: a place freed earlier would let a new request
open sessions while the old ones still count against a worker's --max-sessions.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import time
from typing import AsyncIterator, Callable

import grpc

from specd.serving.status import StatusError

# A worker that does not say its cap (an older one) is taken to have the workers' default.
DEFAULT_WORKER_SESSIONS = 64


class Overloaded(StatusError):
    """Every place is taken and the queue is full: the caller should retry later."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


class QueueDeadlineExceeded(StatusError):
    """The request's deadline passed while it waited for a place."""

    code = grpc.StatusCode.DEADLINE_EXCEEDED


def running_limit(configured: int, worker_caps: list[int]) -> int:
    """Requests run at once: `configured`, or (0) the smallest worker cap less an eighth of it.

    The headroom is for sessions a worker still holds that no running request owns: one whose
    EndSession failed or timed out stays until the worker's idle timeout ends it.
    """
    if configured:
        return configured
    caps = [cap for cap in worker_caps if cap > 0]
    cap = min(caps) if caps else DEFAULT_WORKER_SESSIONS
    return max(1, cap - max(1, cap // 8))


class Place:
    """One admitted request's place; released once, however the request ends."""

    def __init__(self, admission: "Admission", queue_ms: float):
        self.queue_ms = queue_ms  # how long the request waited for it
        self._admission = admission
        self._released = False
        self.handed_off = False  # release_after() took charge of releasing it

    def release(self) -> None:
        if not self._released:
            self._released = True
            self._admission._release()

    def release_after(self, task: asyncio.Future) -> None:
        """Release once `task` (the request's EndSession calls) is done, whatever its outcome."""
        self.handed_off = True
        task.add_done_callback(lambda _: self.release())


class Admission:
    """Places for requests on one event loop (no locks: every call runs on the loop)."""

    def __init__(self, max_running: Callable[[], int], max_queued: int):
        self._max_running = max_running  # read at each decision: it may follow the workers' caps
        self.max_queued = max_queued
        self.running = 0
        self._queue: collections.deque[asyncio.Future] = collections.deque()
        self.on_admitted: Callable[[float], None] | None = None  # gets each admitted request's wait, in s

    @property
    def waiting(self) -> int:
        return len(self._queue)

    @contextlib.asynccontextmanager
    async def place(self, timeout_s: float | None = None) -> AsyncIterator[Place]:
        """A place for the block; released when it ends unless the block handed it off."""
        place = await self.admit(timeout_s)
        try:
            yield place
        finally:
            if not place.handed_off:
                place.release()

    async def admit(self, timeout_s: float | None = None) -> Place:
        """A place now, or after the requests queued before this one; Overloaded if the queue
        is full. A caller cancelled (or past `timeout_s`) while queued leaves the queue."""
        started = time.monotonic()
        self._wake()
        limit = self._max_running()
        if not self._queue and self.running < limit:
            self.running += 1
            return self._admitted(0.0)  # no wait at all: a free place and nobody ahead
        if len(self._queue) >= self.max_queued:
            raise Overloaded(
                f"specd is serving its maximum of {limit} requests with {len(self._queue)} queued; retry later"
            )
        waiter = asyncio.get_running_loop().create_future()
        self._queue.append(waiter)
        try:
            async with asyncio.timeout(timeout_s):
                await waiter
        except TimeoutError:
            self._leave(waiter)
            raise QueueDeadlineExceeded(
                f"the request's deadline passed after {time.monotonic() - started:.1f} s waiting for a place"
            ) from None
        except BaseException:
            self._leave(waiter)
            raise
        return self._admitted(time.monotonic() - started)

    def _admitted(self, waited_s: float) -> Place:
        if self.on_admitted is not None:
            self.on_admitted(waited_s)
        return Place(self, waited_s * 1000.0)

    def _leave(self, waiter: asyncio.Future) -> None:
        """A queued caller gives up: out of the queue, or, if its place came as it left, the
        place passes on."""
        if waiter.done() and not waiter.cancelled():
            self._release()
            return
        waiter.cancel()
        with contextlib.suppress(ValueError):
            self._queue.remove(waiter)

    def _release(self) -> None:
        self.running -= 1
        self._wake()

    def _wake(self) -> None:
        """Give free places to the queue's oldest waiters (also after the limit grew)."""
        while self._queue and self.running < self._max_running():
            waiter = self._queue.popleft()
            if not waiter.done():
                self.running += 1
                waiter.set_result(None)
