"""What the clients of both workers share: sessions, deadlines, re-sync, channels.

The coordinator owns the committed tokens. Each worker session remembers how many
of them it has been sent; a worker that lost the session (restart, expiry) answers
NOT_FOUND or FAILED_PRECONDITION and is sent the whole history again. The clients
themselves: coordinator/target_link.py and coordinator/draft_link.py.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from typing import Awaitable, Callable

import grpc

from specd.core.errors import NO_SESSION_ROOM
from specd.observability.telemetry import trace_metadata
from specd.serving.server import GRPC_OPTIONS
from specd.v1 import common_pb2

log = logging.getLogger(__name__)

_RESYNC_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


def no_session_room(exc: grpc.aio.AioRpcError) -> bool:
    """The worker refused to open a session for want of room (its session cap or KV budget): it is
    up and serves its other sessions. gRPC's own RESOURCE_EXHAUSTED (a message past its size
    limit) is not that."""
    return exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and (exc.details() or "").startswith(NO_SESSION_ROOM)


@dataclasses.dataclass
class WorkerSession:
    """One request's session on one worker: how much of the committed history it was sent."""

    session_id: str
    reserve_tokens: int = 0  # the most tokens the worker's cache will hold for it: its KV room, asked at open
    sent: int = 0
    call_ms: float | None = None  # wall time of the latest call answered through synced_call
    ended: bool = False  # the request is over and its EndSession sent: no call may open it again
    opened: bool = False  # the worker has answered a call of it: it holds (or held) the session
    # Clear while a CatchUp sends a long tail ahead of a call: what waits on that call waits long.
    caught_up: asyncio.Event = dataclasses.field(default_factory=asyncio.Event)

    def __post_init__(self) -> None:
        self.caught_up.set()

    def committed_tail(self, committed: list[int]) -> common_pb2.CommittedTokens:
        return common_pb2.CommittedTokens(start=self.sent, token_ids=committed[self.sent :], reserve_tokens=self.reserve_tokens)

    def answered(self, committed: list[int], cached: int | None) -> None:
        """The worker answered a call sent `committed`; the next call continues from what it caches
        (a worker may cache fewer tokens than it was sent: a prefill keeps the last one back)."""
        self.sent = len(committed) if cached is None else min(len(committed), cached)
        self.opened = True

    def unsure_after(self, position: int) -> None:
        """The worker may hold tokens past `position` that were never committed (a call for an
        outcome that did not come): the next call re-sends the history from there."""
        self.sent = min(self.sent, position)


def remaining_s(deadline: float) -> float:
    """Seconds left before `deadline` (time.monotonic()); DEADLINE_EXCEEDED, as gRPC says it, if none.

    A logical call that takes several RPCs (a resend, a fallback) gives each only what is left,
    so that it fails within one worker timeout, never a fresh one per attempt.
    """
    left = deadline - time.monotonic()
    if left <= 0:
        raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, details="the call's deadline passed before it was sent")
    return left


Call = Callable[[common_pb2.CommittedTokens, float], Awaitable]


@dataclasses.dataclass(frozen=True)
class CatchUp:
    """How a long unsent tail (a prompt, a history resent) reaches a worker: as Prefill calls of
    at most `most_tokens` tokens, each within `timeout_s` of its own, before the call that needs
    it. One call carrying thousands of tokens could outlast any deadline fit for a round on a
    slow worker, and could not be stopped half-way when its request ends."""

    prefill: Callable[[str, common_pb2.CommittedTokens, float], Awaitable]  # (session_id, tail, timeout_s): a Prefill
    most_tokens: int
    timeout_s: float

    async def run(self, session: WorkerSession, committed: list[int]) -> float:
        """Prefill the unsent tail until at most `most_tokens` of it are left; the seconds it took."""
        if len(committed) - session.sent <= self.most_tokens:  # every round's call but a prompt's
            return 0.0
        started = time.monotonic()
        session.caught_up.clear()
        try:
            await self._prefill_chunks(session, committed)
        finally:
            session.caught_up.set()
        return time.monotonic() - started

    async def _prefill_chunks(self, session: WorkerSession, committed: list[int]) -> None:
        resent = False
        while len(committed) - session.sent > self.most_tokens:
            _check_not_ended(session)
            chunk = committed[: session.sent + self.most_tokens]
            try:
                response = await self.prefill(session.session_id, session.committed_tail(chunk), self.timeout_s)
            except grpc.aio.AioRpcError as exc:
                if exc.code() not in _RESYNC_CODES or resent:
                    raise
                _lost(session, exc)
                resent = True
                continue
            # A prefill caches all but its last token: the next chunk starts from what it cached.
            before = session.sent
            session.answered(chunk, response.cached_tokens)
            if session.sent <= before:  # nothing cached: the call that follows sends the rest
                break


async def synced_call(session: WorkerSession, committed: list[int], call: Call, deadline: float, catch_up: CatchUp | None = None):
    """Send the unsent tail; resend everything once if the worker lost the session. Both sends
    share `deadline`: `call(tail, timeout_s)` gets the seconds left, not counting the time a
    `catch_up` took to send a long tail ahead of it. Nothing is (re)sent once the request has
    ended: a resend from 0 after its EndSession would reopen the session on the worker."""
    started = time.monotonic()
    _check_not_ended(session)
    if catch_up is not None:
        deadline += await catch_up.run(session, committed)
    try:
        response = await call(session.committed_tail(committed), remaining_s(deadline))
    except grpc.aio.AioRpcError as exc:
        if exc.code() not in _RESYNC_CODES:
            raise
        _check_not_ended(session)
        _lost(session, exc)
        if catch_up is not None:
            deadline += await catch_up.run(session, committed)
        response = await call(session.committed_tail(committed), remaining_s(deadline))
    session.answered(committed, getattr(response, "cached_tokens", None))
    session.call_ms = (time.monotonic() - started) * 1000.0
    return response


def _lost(session: WorkerSession, exc: grpc.aio.AioRpcError) -> None:
    """The worker lost the session: the next call sends the whole history."""
    log.info("session %s lost on a worker (%s); resending its history", session.session_id, exc.code().name)
    session.sent = 0


def _check_not_ended(session: WorkerSession) -> None:
    if session.ended:  # a call still running when its request was cancelled: it is cancelled too
        raise asyncio.CancelledError(f"session {session.session_id} ended with its request")


# gRPC's default reconnect back-off grows to 120 s: a worker back after a long outage would be
# refused (UNAVAILABLE without a connection attempt) for up to two minutes. Keep retrying every second.
_RECONNECT_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 200),
    ("grpc.max_reconnect_backoff_ms", 1000),
]
# A worker whose node vanishes sends no RST: pings notice a dead connection in ~30 s even
# between calls, instead of waiting for a call's deadline or the kernel's TCP timeout.
_KEEPALIVE_OPTIONS = [
    ("grpc.keepalive_time_ms", 20_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
]


def call_metadata_source(interceptors: list | None) -> Callable[[], tuple]:
    """What each worker call sends as metadata: the interceptors carry the traceparent when
    there are any (tracing records spans); without them the call carries it itself."""
    return (lambda: ()) if interceptors else trace_metadata


def worker_channel(address: str, interceptors: list | None, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """A channel to a worker: TLS with `credentials` (specd.serving.tls.channel_credentials), else plaintext."""
    options = GRPC_OPTIONS + _RECONNECT_OPTIONS + _KEEPALIVE_OPTIONS
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
