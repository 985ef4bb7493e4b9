"""The coordinator's client of the target worker: Prefill, Verify and VerifyAfter, each within a
deadline; a target that cannot be reached in time is UNAVAILABLE to the caller."""

from __future__ import annotations

import time
from typing import Iterable

import grpc
from opentelemetry import trace

from coordinator.session_wait import FIRST_WAIT_S, LONGEST_WAIT_S, SessionWait, out_of_sessions
from coordinator.workers import CatchUp, WorkerSession, call_metadata_source, remaining_s, synced_call, worker_channel
from specd.core.sampling import SamplingSettings, SparseDist
from specd.serving.status import StatusError, Unavailable
from specd.v1 import common_pb2, target_pb2, target_pb2_grpc
from specd.wire.convert import sampling_to_proto, sparse_to_proto

SESSION_WAIT_EVENT = "specd.session_wait"  # a span event: the request waited for a target session


class TargetUnavailable(Unavailable):
    """The target worker cannot serve: the request fails with UNAVAILABLE."""


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
        self,
        address: str,
        timeout_s: float,
        interceptors: list | None = None,
        credentials: grpc.ChannelCredentials | None = None,
        call_tokens: int = 0,
        session_wait_s: float = 60.0,
    ):
        """`call_tokens`: the most committed tokens one call sends; a longer tail goes ahead as
        Prefill calls of that many (workers.CatchUp). 0: any number. `session_wait_s`: the most a
        request waits for a session the target has no room for, before it fails RESOURCE_EXHAUSTED."""
        self.session_wait_s = session_wait_s
        self.address = address
        self.timeout_s = timeout_s
        self._channel = worker_channel(address, interceptors, credentials)
        self._metadata = call_metadata_source(interceptors)
        self._stub = target_pb2_grpc.TargetWorkerStub(self._channel)
        self._catch_up = CatchUp(self._prefill_call, call_tokens, timeout_s) if call_tokens else None
        self.session_wait = SessionWait()

    def _error(self, exc: grpc.aio.AioRpcError) -> StatusError:
        """UNAVAILABLE when the target cannot be reached in time; its own status otherwise."""
        message = f"target worker at {self.address}: {exc.code().name}: {exc.details()}"
        if exc.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
            return TargetUnavailable(message)
        return StatusError(message, exc.code())

    def deadline(self) -> float:
        """The deadline of a logical call starting now (time.monotonic())."""
        return time.monotonic() + self.timeout_s

    async def connected(self) -> None:
        """Wait until the channel to the target is connected (a reconnect, after a backoff, included)."""
        await self._channel.channel_ready()

    async def info(self, timeout_s: float | None = None) -> target_pb2.TargetInfo:
        return await self._stub.Info(target_pb2.TargetInfoRequest(), metadata=self._metadata(), timeout=timeout_s or self.timeout_s)

    async def _prefill_call(self, session_id: str, tail: common_pb2.CommittedTokens, timeout_s: float):
        request = target_pb2.TargetPrefillRequest(session_id=session_id, committed=tail)
        return await self._stub.Prefill(request, metadata=self._metadata(), timeout=timeout_s)

    async def prefill(self, session: WorkerSession, committed: list[int]) -> target_pb2.TargetPrefillResponse:
        async def call(tail, timeout_s):
            return await self._prefill_call(session.session_id, tail, timeout_s)

        return await self._synced(session, committed, call, self.deadline())

    async def open_session(self, session: WorkerSession, committed: list[int]) -> None:
        """While the target refuses sessions, open the request's on its own, waiting for one there:
        a one-token Prefill, which runs no forward (a prefill caches all but its last token)."""
        if self.session_wait.full and not session.opened:
            await self.prefill(session, committed[:1])

    async def _synced(self, session: WorkerSession, committed: list[int], call, deadline: float):
        """synced_call; a new session the target has no room for waits until one frees."""
        try:
            return await synced_call(session, committed, call, deadline, self._catch_up)
        except grpc.aio.AioRpcError as exc:
            if not out_of_sessions(exc, session):
                raise self._error(exc) from None
        return await self._once_a_session_frees(session, committed, call, deadline)

    async def _once_a_session_frees(self, session: WorkerSession, committed: list[int], call, deadline: float):
        """The refused call, sent again in this request's turn after each wait (coordinator/session_wait.py);
        its deadline moves on by the time it waited, for at most session_wait_s in all: then the
        target's refusal is the request's. The wait is an event on the current span."""
        refused_at = time.monotonic()
        give_up = refused_at + self.session_wait_s
        refusals = 1
        try:
            async with self.session_wait.turn():
                wait_s = FIRST_WAIT_S
                while True:
                    started = time.monotonic()
                    await self.session_wait.wait(min(wait_s, max(give_up - started, 0.0)))
                    deadline += time.monotonic() - started
                    try:
                        return await synced_call(session, committed, call, deadline, self._catch_up)
                    except grpc.aio.AioRpcError as exc:
                        if not out_of_sessions(exc, session):
                            raise self._error(exc) from None
                        refusals += 1
                        if time.monotonic() >= give_up:
                            raise self._error(exc) from None
                    wait_s = min(2 * wait_s, LONGEST_WAIT_S)
        finally:
            waited_ms = (time.monotonic() - refused_at) * 1000.0
            trace.get_current_span().add_event(
                SESSION_WAIT_EVENT, {"specd.session_wait_ms": waited_ms, "specd.refusals": refusals, "specd.opened": session.opened}
            )

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

        return await self._synced(session, committed, call, deadline or self.deadline())

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
        try:
            await self._stub.EndSession(request, metadata=self._metadata(), timeout=5.0)
        finally:
            self.session_wait.freed()  # a request waiting for a session may have one now

    async def close(self) -> None:
        await self._channel.close()
