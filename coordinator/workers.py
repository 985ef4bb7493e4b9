"""Clients of the two workers: deadlines, session re-sync, and the draft's availability.

The coordinator owns the committed tokens. Each worker session remembers how many
of them it has been sent; a worker that lost the session (restart, expiry) answers
NOT_FOUND or FAILED_PRECONDITION and is sent the whole history again.
"""

from __future__ import annotations

import asyncio
import contextvars
import dataclasses
import logging
import time
from typing import Awaitable, Callable, Iterable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.speculation_cache import SpeculationCache
from specd.outcomes import guessed_outcomes
from specd.sampling import SamplingSettings, SparseDist
from specd.serving import GRPC_OPTIONS, StatusError, Unavailable
from specd.telemetry import trace_metadata
from specd.v1 import common_pb2, draft_pb2, draft_pb2_grpc, target_pb2, target_pb2_grpc
from specd.wire import sampling_to_proto, sparse_to_proto

log = logging.getLogger(__name__)

_RESYNC_CODES = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


class TargetUnavailable(Unavailable):
    """The target worker cannot serve: the request fails with UNAVAILABLE."""


class DraftFailed(RuntimeError):
    """A draft call failed: the round goes on target-only."""


@dataclasses.dataclass
class WorkerSession:
    """One request's session on one worker: how much of the committed history it was sent."""

    session_id: str
    sent: int = 0
    call_ms: float | None = None  # wall time of the latest call answered through _synced_call
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


async def _synced_call(
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


def _trace_metadata_source(interceptors: list | None) -> Callable[[], tuple]:
    """What each worker call sends as metadata: the interceptors carry the traceparent when
    there are any (tracing records spans); without them the call carries it itself."""
    return (lambda: ()) if interceptors else trace_metadata


def _channel(address: str, interceptors: list | None, credentials: grpc.ChannelCredentials | None = None) -> grpc.aio.Channel:
    """A channel to a worker: TLS with `credentials` (specd.tls.channel_credentials), else plaintext."""
    options = GRPC_OPTIONS + _RECONNECT_OPTIONS + _KEEPALIVE_OPTIONS
    if credentials is not None:
        return grpc.aio.secure_channel(address, credentials, options=options, interceptors=interceptors)
    return grpc.aio.insecure_channel(address, options=options, interceptors=interceptors)


def verify_request(
    session_id: str,
    tail: common_pb2.CommittedTokens,
    draft_tokens: list[int],
    draft_probs: Iterable[common_pb2.SparseDistribution],
    sampling: SamplingSettings,
    return_logprobs: bool,
) -> target_pb2.VerifyRequest:
    """A Verify of `draft_tokens` after `tail`; greedy verifies send no draft distributions."""
    return target_pb2.VerifyRequest(
        session_id=session_id,
        committed=tail,
        draft_tokens=draft_tokens,
        draft_probs=[] if sampling.greedy else draft_probs,
        sampling=sampling_to_proto(sampling),
        return_logprobs=return_logprobs,
    )


class TargetLink:
    def __init__(
        self, address: str, timeout_s: float, interceptors: list | None = None, credentials: grpc.ChannelCredentials | None = None
    ):
        self.address = address
        self.timeout_s = timeout_s
        self._channel = _channel(address, interceptors, credentials)
        self._metadata = _trace_metadata_source(interceptors)
        self._stub = target_pb2_grpc.TargetWorkerStub(self._channel)

    def _error(self, exc: grpc.aio.AioRpcError) -> StatusError:
        """UNAVAILABLE when the target cannot be reached in time; its own status otherwise."""
        message = f"target worker at {self.address}: {exc.code().name}: {exc.details()}"
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return TargetUnavailable(message)
        return StatusError(message, exc.code())

    def deadline(self) -> float:
        """The deadline of a logical call starting now (time.monotonic())."""
        return time.monotonic() + self.timeout_s

    async def info(self, timeout_s: float | None = None) -> target_pb2.TargetInfo:
        return await self._stub.Info(target_pb2.TargetInfoRequest(), metadata=self._metadata(), timeout=timeout_s or self.timeout_s)

    async def prefill(self, session: WorkerSession, committed: list[int]) -> target_pb2.TargetPrefillResponse:
        async def call(tail, timeout_s):
            request = target_pb2.TargetPrefillRequest(session_id=session.session_id, committed=tail)
            return await self._stub.Prefill(request, metadata=self._metadata(), timeout=timeout_s)

        try:
            return await _synced_call(session, committed, call, self.deadline())
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def verify(
        self,
        session: WorkerSession,
        committed: list[int],
        draft_tokens: list[int],
        draft_dists: list[SparseDist],
        sampling: SamplingSettings,
        return_logprobs: bool,
        deadline: float | None = None,
    ) -> target_pb2.VerifyResponse:
        """`deadline`: that of the logical call this Verify is part of (a VerifyAfter it stands
        in for); by default one worker timeout from now."""

        async def call(tail, timeout_s):
            probs = [] if sampling.greedy else [sparse_to_proto(d) for d in draft_dists]
            request = verify_request(session.session_id, tail, draft_tokens, probs, sampling, return_logprobs)
            return await self._stub.Verify(request, metadata=self._metadata(), timeout=timeout_s)

        try:
            return await _synced_call(session, committed, call, deadline or self.deadline())
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def verify_after(
        self, session_id: str, after: int, choices: list[target_pb2.VerifyChoice], deadline: float
    ) -> target_pb2.VerifyAfterResponse:
        """Verifies sent ahead of the outcome of the session's verify at `after` committed tokens."""
        request = target_pb2.VerifyAfterRequest(session_id=session_id, after=after, choices=choices)
        try:
            return await self._stub.VerifyAfter(request, metadata=self._metadata(), timeout=remaining_s(deadline))
        except grpc.aio.AioRpcError as exc:
            raise self._error(exc) from None

    async def end_session(self, session_id: str) -> None:
        """End a request's session for good: retire_id, since no request reuses an id, so that a
        call of the request still on its way is refused instead of opening the session again."""
        request = target_pb2.TargetEndSessionRequest(session_id=session_id, retire_id=True)
        await self._stub.EndSession(request, metadata=self._metadata(), timeout=5.0)

    async def close(self) -> None:
        await self._channel.close()


class DraftLink:
    """The draft worker, or its absence.

    After a failure or a timeout the draft is down: no round asks it anything until it has
    answered its health check again. A background probe watches the draft's health and asks its
    Info once it reports SERVING (an unreachable draft is tried again every `retry_s`), so no
    round ever waits on a draft that is down, and one that is back is used at once.
    """

    def __init__(
        self,
        address: str,
        timeout_s: float,
        retry_s: float,
        interceptors: list | None = None,
        credentials: grpc.ChannelCredentials | None = None,
    ):
        self.address = address
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._channel = _channel(address, interceptors, credentials)
        self._metadata = _trace_metadata_source(interceptors)
        self._stub = draft_pb2_grpc.DraftWorkerStub(self._channel)
        self._health = health_pb2_grpc.HealthStub(self._channel)
        self.info: draft_pb2.DraftInfo | None = None
        self.expected_fingerprint = ""
        self.rejected_reason = ""  # set for good when the draft's tokenizer differs from the target's
        self._probe: asyncio.Task | None = None
        self.last_error = "the draft worker has not been reached yet"

    async def check(self, timeout_s: float = 2.0, wait_for_ready: bool = False) -> bool:
        """Ask the draft for its Info; usable only if it shares the target's tokenizer.
        wait_for_ready: wait (within timeout_s) for a channel still reconnecting to connect."""
        try:
            info = await self._stub.Info(
                draft_pb2.DraftInfoRequest(), metadata=self._metadata(), timeout=timeout_s, wait_for_ready=wait_for_ready
            )
        except grpc.aio.AioRpcError as exc:
            self.mark_down(f"draft worker at {self.address}: {exc.code().name}: {exc.details()}")
            return False
        if info.tokenizer_fingerprint != self.expected_fingerprint:
            self.rejected_reason = (
                f"the draft model {info.model!r} maps strings to different token ids than the target "
                "model; serve a draft that shares the target's tokenizer"
            )
            self.last_error = self.rejected_reason
            return False
        if self.info is None:
            log.info("draft worker at %s answers its health check: speculating again", self.address)
        self.info = info
        return True

    def mark_down(self, reason: str) -> None:
        """Stop asking the draft until its health check answers; the probe starts if it has not."""
        if self.info is not None:
            log.warning("%s; decoding target-only until the draft answers its health check", reason)
        self.info = None
        self.last_error = reason
        self._start_probe()

    def timed_out(self, waited_s: float) -> str:
        """A round gave up waiting for the draft after `waited_s`: the draft is down; why, for the round."""
        self.mark_down(f"draft worker at {self.address} did not answer within {waited_s * 1000.0:.0f} ms")
        return self.last_error

    def usable(self) -> bool:
        """True if the draft can take this round. Never waits: a draft that is down is probed
        in the background (and the probe started here if nothing has started it yet)."""
        if self.rejected_reason:
            return False
        if self.info is None:
            self._start_probe()
            return False
        return True

    def _start_probe(self) -> None:
        if self._probe is not None and not self._probe.done():
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # no loop to probe from (a caller outside the server): the next usable() starts it
            return
        # An empty context: the probe belongs to no request, so its calls join no request's trace.
        self._probe = loop.create_task(self._probe_until_back(), context=contextvars.Context())

    async def _probe_until_back(self) -> None:
        """Until the draft answers its Info again (or is rejected for good): watch its health and
        ask Info the moment it says SERVING, so a draft that finishes loading, is restarted or
        resumes (SIGCONT) is used again at once; one that cannot be reached is retried every retry_s."""
        while self.info is None and not self.rejected_reason:
            if await self._serving_again() and await self.check(wait_for_ready=True):
                return
            await asyncio.sleep(self.retry_s)

    async def _serving_again(self) -> bool:
        """Wait on the draft's health Watch until it reports SERVING; False if the stream fails or ends."""
        call = self._health.Watch(health_pb2.HealthCheckRequest(), wait_for_ready=True)
        try:
            async for reply in call:
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return True
        except grpc.aio.AioRpcError:
            return False
        finally:
            call.cancel()
        return False

    def stop_probe(self) -> None:
        if self._probe is not None:
            self._probe.cancel()

    async def _call(self, make_call: Callable[[], Awaitable]):
        try:
            return await make_call()
        except grpc.aio.AioRpcError as exc:
            self.mark_down(f"draft worker at {self.address}: {exc.code().name}: {exc.details()}")
            raise DraftFailed(self.last_error) from None

    async def propose(
        self,
        session: WorkerSession,
        committed: list[int],
        num_tokens: int,
        sampling: SamplingSettings,
        max_support: int,
        saguaro: draft_pb2.SaguaroParams | None = None,
    ) -> draft_pb2.ProposeResponse:
        async def call(tail, timeout_s):
            request = draft_pb2.ProposeRequest(
                session_id=session.session_id,
                committed=tail,
                num_tokens=num_tokens,
                sampling=sampling_to_proto(sampling),
                max_support=max_support,
                saguaro=saguaro,
            )
            return await self._stub.Propose(request, metadata=self._metadata(), timeout=timeout_s)

        return await self._call(lambda: _synced_call(session, committed, call, time.monotonic() + self.timeout_s))

    async def speculate(
        self,
        session: WorkerSession,
        committed: list[int],
        request: draft_pb2.SpeculateRequest,
        guesses: asyncio.Future,
    ) -> SpeculationCache:
        """SSD: run Speculate and return its cache; cancelling the caller cancels the build.

        `guesses` gets the set of (k, t*) the cache will hold as soon as the draft knows them,
        one forward into the build.
        """

        async def call(tail, timeout_s):
            request.committed.CopyFrom(tail)
            cache = draft_pb2.SpeculationCache()  # a build with no branches sends none
            async for message in self._stub.Speculate(request, metadata=self._metadata(), timeout=timeout_s):
                if message.HasField("guesses"):
                    if not guesses.done():
                        guesses.set_result(guessed_outcomes(message.guesses))
                else:
                    cache = message.cache
            return SpeculationCache.from_wire(cache)

        return await self._call(lambda: _synced_call(session, committed, call, time.monotonic() + self.timeout_s))

    async def end_session(self, session_id: str) -> None:
        """End a request's session for good: retire_id, since no request reuses an id, so that a
        call of the request still on its way is refused instead of opening the session again."""
        request = draft_pb2.DraftEndSessionRequest(session_id=session_id, retire_id=True)
        await self._stub.EndSession(request, metadata=self._metadata(), timeout=5.0)

    async def close(self) -> None:
        self.stop_probe()
        await self._channel.close()
