"""The coordinator's client of the draft worker: Propose and Speculate, and whether the draft is
usable at all (a draft that failed is probed in the background until it is back)."""

from __future__ import annotations

import asyncio
import contextvars
import logging
import sys
import time
from typing import Awaitable, Callable

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from coordinator.speculation_cache import SpeculationCache
from coordinator.workers import CatchUp, WorkerSession, call_metadata_source, no_session_room, synced_call, worker_channel
from specd.core.sampling import SamplingSettings
from specd.v1 import draft_pb2, draft_pb2_grpc
from specd.wire.convert import sampling_to_proto
from specd.wire.outcomes import guessed_outcomes

log = logging.getLogger(__name__)


class DraftFailed(RuntimeError):
    """A draft call failed: the round goes on target-only."""


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
        call_tokens: int = 0,
    ):
        """`call_tokens`: as TargetLink's."""
        self.address = address
        self.timeout_s = timeout_s
        self.retry_s = retry_s
        self._channel = worker_channel(address, interceptors, credentials)
        self._metadata = call_metadata_source(interceptors)
        self._stub = draft_pb2_grpc.DraftWorkerStub(self._channel)
        self._catch_up = CatchUp(self._prefill_call, call_tokens, timeout_s) if call_tokens else None
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

    def room(self, committed: int) -> int:
        """Tokens the draft's context still holds after `committed` ones (a call past its
        context length is refused); unbounded while its Info is not known."""
        info = self.info
        if info is None or not info.context_length:
            return sys.maxsize
        return info.context_length - committed

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
            reason = f"draft worker at {self.address}: {exc.code().name}: {exc.details()}"
            if not no_session_room(exc):
                self.mark_down(reason)
            # A draft with no room for this request's session (its cap, shared with other
            # coordinators) serves the others: this request's round alone goes target-only.
            raise DraftFailed(reason) from None

    async def _prefill_call(self, session_id: str, tail, timeout_s: float) -> draft_pb2.DraftPrefillResponse:
        request = draft_pb2.DraftPrefillRequest(session_id=session_id, committed=tail)
        return await self._stub.Prefill(request, metadata=self._metadata(), timeout=timeout_s)

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

        return await self._call(lambda: synced_call(session, committed, call, time.monotonic() + self.timeout_s, self._catch_up))

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

        return await self._call(lambda: synced_call(session, committed, call, time.monotonic() + self.timeout_s, self._catch_up))

    async def end_session(self, session_id: str) -> None:
        """End a request's session for good: retire_id, since no request reuses an id, so that a
        call of the request still on its way is refused instead of opening the session again."""
        request = draft_pb2.DraftEndSessionRequest(session_id=session_id, retire_id=True)
        await self._stub.EndSession(request, metadata=self._metadata(), timeout=5.0)

    async def close(self) -> None:
        self.stop_probe()
        await self._channel.close()
