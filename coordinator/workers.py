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

from specd.serving import GRPC_OPTIONS
from specd.telemetry import trace_metadata
from specd.v1 import common_pb2

log = logging.getLogger(__name__)

_RESYNC_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


@dataclasses.dataclass
class WorkerSession:
    """One request's session on one worker: how much of the committed history it was sent."""

    session_id: str
    sent: int = 0
    call_ms: float | None = None  # wall time of the latest call answered through synced_call
    ended: bool = False  # the request is over and its EndSession sent: no call may open it again

    def committed_tail(self, committed: list[int]) -> common_pb2.CommittedTokens:
        return common_pb2.CommittedTokens(start=self.sent, token_ids=committed[self.sent :])

    def answered(self, committed: list[int], cached: int | None) -> None:
        """The worker answered a call sent `committed`; the next call continues from what it caches
        (a worker may cache fewer tokens than it was sent: a prefill keeps the last one back)."""
        self.sent = len(committed) if cached is None else min(len(committed), cached)

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


async def synced_call(
    session: WorkerSession,
    committed: list[int],
    call: Callable[[common_pb2.CommittedTokens, float], Awaitable],
    deadline: float,
):
    """Send the unsent tail; resend everything once if the worker lost the session. Both sends
    share `deadline`: `call(tail, timeout_s)` gets the seconds left. Nothing is (re)sent once the
    request has ended: a resend from 0 after its EndSession would reopen the session on the worker."""
    started = time.monotonic()
    _check_not_ended(session)
    try:
        response = await call(session.committed_tail(committed), remaining_s(deadline))
    except grpc.aio.AioRpcError as exc:
        if exc.code() not in _RESYNC_CODES:
            raise
        _check_not_ended(session)
        log.info("session %s lost on a worker (%s); resending its history", session.session_id, exc.code().name)
        session.sent = 0
        response = await call(session.committed_tail(committed), remaining_s(deadline))
    session.answered(committed, getattr(response, "cached_tokens", None))
    session.call_ms = (time.monotonic() - started) * 1000.0
    return response


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
    """A channel to a worker: TLS with `credentials` (specd.tls.channel_credentials), else plaintext."""
    options = GRPC_OPTIONS + _RECONNECT_OPTIONS + _KEEPALIVE_OPTIONS
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)
