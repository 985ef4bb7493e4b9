"""Coordinator gRPC servicer: Generate (unary and streaming) and ModelInfo."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
from typing import AsyncIterator

import grpc
from opentelemetry import trace

from coordinator.admission import Admission, running_limit
from coordinator.config import CoordinatorConfig
from coordinator.draft_link import DraftLink
from coordinator.generation import Generator
from coordinator.output import Chunk, Finish
from coordinator.profiles import SpeculationProfile
from coordinator.request import ResolvedRequest, TargetFacts, check, resolve
from coordinator.request_log import RequestRecord
from coordinator.round_trace import grpc_caller, llm_request, llm_request_stream
from coordinator.target_link import TargetLink
from specd.observability.telemetry import get_tracer, trace_id_hex
from specd.serving.status import ModelLoading, rpc_edge
from specd.v1 import coordinator_pb2, coordinator_pb2_grpc
from specd.wire.checks import MAX_ID_BYTES

log = logging.getLogger(__name__)


# Threads for tokenising prompts and detokenising rounds: a request's text work never holds the
# event loop, so one large prompt does not delay other requests (prompts are bounded in bytes).
# Requests past _LARGE_REQUEST_BYTES tokenise on threads of their own: a queue of large prompts
# never holds up a small one.
_PROMPT_THREADS = 4
_TEXT_THREADS = 4
_LARGE_REQUEST_BYTES = 64 * 1024


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    """The public RPCs: a request is checked, admitted, resolved, then run by the Generator."""

    def __init__(
        self, config: CoordinatorConfig, target: TargetLink, draft: DraftLink | None, tracer: trace.Tracer | None = None, metrics=None
    ):
        self.config = config
        self.target = target
        self.draft = draft
        self.facts: TargetFacts | None = None  # set once the target worker has answered
        self.profile: SpeculationProfile | None = None  # the tuned defaults of the target's device, then too
        self.tracer = tracer or get_tracer(None)
        self.metrics = metrics
        self.admission = Admission(self._running_limit, config.max_queued_requests)
        self._draft_max_sessions = 0  # the draft's cap as last seen (it is kept while the draft is down)
        # Separate pools: prompts waiting to be tokenised never delay a running stream's text.
        sizes = {"prompt": _PROMPT_THREADS, "large-prompt": _PROMPT_THREADS, "text": _TEXT_THREADS}
        self._pools = {
            name: concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"coordinator-{name}")
            for name, threads in sizes.items()
        }
        self.generator = Generator(config, target, draft, self._pools["text"], self.tracer, metrics)

    def close(self) -> None:
        """Stop the text threads (once the server has stopped)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    def connected(self, facts: TargetFacts, profile: SpeculationProfile) -> None:
        """The target worker answered: what it serves, and the tuned defaults of its device."""
        self.facts, self.profile = facts, profile

    async def _resolve(self, request: coordinator_pb2.GenerateRequest) -> ResolvedRequest:
        """resolve() on a prompt thread: it tokenises, or renders a chat template."""
        return await self._on_prompt_thread(resolve, request)

    async def _check(self, request: coordinator_pb2.GenerateRequest) -> None:
        """check() on a prompt thread: a large prompt's size in bytes takes a moment to count."""
        await self._on_prompt_thread(check, request)

    async def _on_prompt_thread(self, work, request: coordinator_pb2.GenerateRequest):
        facts = self.ready_facts()
        pool = self._pools["large-prompt" if request.ByteSize() > _LARGE_REQUEST_BYTES else "prompt"]
        return await asyncio.get_running_loop().run_in_executor(
            pool, work, request, facts, self.config, self.profile.num_speculative_tokens
        )

    def ready_facts(self) -> TargetFacts:
        if self.facts is None:
            raise ModelLoading(f"the coordinator is waiting for the target worker at {self.target.address}")
        return self.facts

    def _running_limit(self) -> int:
        """--max-concurrent-requests, or sized from the caps the workers said in their Info."""
        if self.draft is not None and self.draft.info is not None:
            self._draft_max_sessions = self.draft.info.max_sessions
        target_cap = self.facts.max_sessions if self.facts is not None else 0
        return running_limit(self.config.max_concurrent_requests, [target_cap, self._draft_max_sessions])

    async def Generate(self, request, context):
        with llm_request(self.tracer, grpc_caller(context, "Generate")) as span:
            return await self._generate(request, context, _record(request, trace_id_hex(span)))

    async def GenerateStream(self, request, context):
        messages = llm_request_stream(
            self.tracer,
            grpc_caller(context, "GenerateStream"),
            lambda trace_id: self._generate_stream(request, context, _record(request, trace_id)),
        )
        async with contextlib.aclosing(messages):
            async for message in messages:
                yield message

    @contextlib.asynccontextmanager
    async def admitted(
        self, request: coordinator_pb2.GenerateRequest, timeout_s: float | None, record: RequestRecord | None = None
    ) -> AsyncIterator[tuple[ResolvedRequest, AsyncIterator[Chunk | Finish]]]:
        """The resolved request and its events, once it has a place (it may queue for one; the queue's wait
        ends after timeout_s, the call's deadline, if it has one). While loading, UNAVAILABLE comes before
        any queueing. Every public API (gRPC, HTTP) runs its requests through here. `record`, the
        front's (Generator.run makes one without it), is filled in as the request runs."""
        self.ready_facts()
        await self._check(request)  # bad input is told so at once, not queued, nor told to retry
        async with self.admission.place(timeout_s) as place:
            resolved = await self._resolve(request)
            # Closed here, not when collected: its sessions are ended before the place is let go.
            events = self.generator.run(resolved, self.ready_facts(), self.profile, place, record)
            async with contextlib.aclosing(events) as events:
                yield resolved, events

    def _failed(self, code: grpc.StatusCode, record: RequestRecord) -> None:
        """A Generate call that ended without its request finishing: logged and counted once."""
        record.failed(self.metrics, code.name)

    @rpc_edge(on_failure=_failed)
    async def _generate(self, request, context, record: RequestRecord):
        trace_id = record.trace_id
        async with self.admitted(request, context.time_remaining(), record) as (resolved, events):
            async for event in events:
                if isinstance(event, Finish):
                    return coordinator_pb2.GenerateResponse(
                        text=event.text,
                        token_ids=event.token_ids,
                        logprobs=event.logprobs,
                        **event.response_fields(resolved.request_id, trace_id),
                    )

    @rpc_edge(on_failure=_failed)
    async def _generate_stream(self, request, context, record: RequestRecord):
        trace_id = record.trace_id
        async with self.admitted(request, context.time_remaining(), record) as (resolved, events):
            async for event in events:
                if isinstance(event, Finish):
                    yield coordinator_pb2.GenerateStreamResponse(**event.response_fields(resolved.request_id, trace_id))
                elif event.token_ids or event.text:
                    yield coordinator_pb2.GenerateStreamResponse(
                        text=event.text,
                        token_ids=event.token_ids,
                        logprobs=event.logprobs,
                        request_id=resolved.request_id,
                        trace_id=trace_id,
                    )

    @rpc_edge
    async def ModelInfo(self, request, context):
        facts = self.ready_facts()
        draft_info = self.draft.info if self.draft is not None else None
        return coordinator_pb2.ModelInfoResponse(
            target_model=facts.model,
            draft_model=draft_info.model if draft_info is not None else "",
            vocab_size=facts.vocab_size,
            context_length=facts.context_length,
            draft_available=draft_info is not None,
            tensor_parallel=facts.tensor_parallel,
            max_new_tokens_limit=self.config.max_new_tokens_limit,
            default_num_speculative_tokens=self.profile.num_speculative_tokens,
        )


def caller_request_id(request_id: str) -> str:
    """A caller's request id as a record logs it before the request is resolved: cut to
    MAX_ID_BYTES characters (an id too long, which the call is refused for, is not logged whole)."""
    return request_id[:MAX_ID_BYTES]


def _record(request: coordinator_pb2.GenerateRequest, trace_id: str) -> RequestRecord:
    """A Generate call's record, from its start: its trace id and its caller's request id."""
    return RequestRecord(request_id=caller_request_id(request.request_id), trace_id=trace_id)
