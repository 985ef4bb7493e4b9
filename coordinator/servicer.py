"""Coordinator gRPC servicer: Generate (unary and streaming) and ModelInfo."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import logging
import time
import uuid
from typing import AsyncIterator

from opentelemetry import trace

from coordinator.admission import Admission, Place, running_limit
from coordinator.load import UNLIMITED, SpeculationLoad
from coordinator.payoff import RoundCosts, SpeculationPayoff
from coordinator.speculation_gain import RoundClock, SpeculationGain
from coordinator.config import CoordinatorConfig
from coordinator.draft_wait import DraftWait
from coordinator.output import Chunk, Finish, RequestOutput, settle_text
from coordinator.request import ResolvedRequest, TargetFacts, check, resolve
from coordinator.rounds import Generation, RoundResult, drop_target_prefill, sd_rounds, start_target_prefill
from coordinator.ssd_rounds import ssd_rounds
from coordinator.round_trace import RoundTrace, llm_request, llm_request_stream, record_request, record_response
from coordinator.stats import RequestStats
from coordinator.text import TextAssembler
from coordinator.draft_link import DraftLink
from coordinator.target_link import TargetLink
from specd.modes import AUTO, OFF, SD, SSD
from specd.sampling import SamplingSettings
from specd.serving import ModelLoading, abort_on_error
from specd.telemetry import get_tracer, trace_id_hex
from specd.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


# Threads for tokenising prompts and detokenising rounds: a request's text work never holds the
# event loop, so one large prompt does not delay other requests (prompts are bounded in bytes).
# Requests past _LARGE_REQUEST_BYTES tokenise on threads of their own: a queue of large prompts
# never holds up a small one.
_PROMPT_THREADS = 4
_TEXT_THREADS = 4
_LARGE_REQUEST_BYTES = 64 * 1024


class CoordinatorServicer(coordinator_pb2_grpc.CoordinatorServicer):
    def __init__(self, config: CoordinatorConfig, target: TargetLink, draft: DraftLink | None):
        self.config = config
        self.target = target
        self.draft = draft
        self.facts: TargetFacts | None = None  # set once the target worker has answered
        self.tracer = get_tracer(None)  # the service's tracer and metrics, set by start_coordinator
        self.metrics = None
        self.admission = Admission(self._running_limit, config.max_queued_requests)
        self._draft_max_sessions = 0  # the draft's cap as last seen (it is kept while the draft is down)
        self.round_costs = RoundCosts()  # what sd rounds cost now, measured across requests
        # Requests in their rounds now: what speculation under load counts. Not the admitted
        # places, which a request holds until its EndSession calls are answered: the request
        # after it would find one more running than decodes beside it.
        self.decoding = 0
        # Separate pools: prompts waiting to be tokenised never delay a running stream's text.
        sizes = {"prompt": _PROMPT_THREADS, "large-prompt": _PROMPT_THREADS, "text": _TEXT_THREADS}
        self._pools = {
            name: concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix=f"coordinator-{name}")
            for name, threads in sizes.items()
        }

    def close(self) -> None:
        """Stop the text threads (once the server has stopped)."""
        for pool in self._pools.values():
            pool.shutdown(wait=False, cancel_futures=True)

    async def _resolve(self, request: coordinator_pb2.GenerateRequest) -> ResolvedRequest:
        """resolve() on a prompt thread: it tokenises, or renders a chat template."""
        return await self._on_prompt_thread(resolve, request)

    async def _check(self, request: coordinator_pb2.GenerateRequest) -> None:
        """check() on a prompt thread: a large prompt's size in bytes takes a moment to count."""
        await self._on_prompt_thread(check, request)

    async def _on_prompt_thread(self, work, request: coordinator_pb2.GenerateRequest):
        facts = self._ready_facts()
        pool = self._pools["large-prompt" if request.ByteSize() > _LARGE_REQUEST_BYTES else "prompt"]
        return await asyncio.get_running_loop().run_in_executor(pool, work, request, facts, self.config)

    def _ready_facts(self) -> TargetFacts:
        if self.facts is None:
            raise ModelLoading(f"the coordinator is waiting for the target worker at {self.target.address}")
        return self.facts

    def _running_limit(self) -> int:
        """--max-concurrent-requests, or sized from the caps the workers said in their Info."""
        if self.draft is not None and self.draft.info is not None:
            self._draft_max_sessions = self.draft.info.max_sessions
        target_cap = self.facts.max_sessions if self.facts is not None else 0
        return running_limit(self.config.max_concurrent_requests, [target_cap, self._draft_max_sessions])

    def _run_mode(self, asked: str) -> str:
        mode = self.config.default_mode if asked == AUTO else asked
        if mode == AUTO:
            mode = SSD if self.draft is not None else OFF
        return mode

    async def generate(self, request: ResolvedRequest, place: Place | None = None) -> AsyncIterator[Chunk | Finish]:
        """A request's life: its rounds, each round's tokens committed as text, then how it ended.
        `place`, its admission, is released once its worker sessions are ended."""
        text = TextAssembler(self._ready_facts().tokenizer, request.prompt_ids, request.stop_strings)
        output = RequestOutput(text, prompt_len=len(request.prompt_ids))
        span = trace.get_current_span()  # llm_request
        record_request(span, request)
        gen = self._generation(request)
        stats = RequestStats(requested_mode=gen.mode, seed=request.sampling.seed)
        stats.queue_ms = place.queue_ms if place is not None else 0.0
        if self.metrics is not None:
            self.metrics.requests_in_flight.inc()
        rounds = self._rounds(gen)
        gain = RoundClock(gen.load) if isinstance(gen.load, SpeculationGain) else None
        self.decoding += 1
        try:
            async for result in rounds:
                stats.add(result)
                if gain is not None:
                    gain.observe(result.num_draft, len(result.tokens))
                yield await self._commit(gen, result, output)
                if output.done:
                    break
        finally:
            # Closed before the sessions are ended: a request cancelled between rounds (while
            # committing, or at the yield) leaves its loop suspended with the next round's calls
            # started, and one of them reaching the draft after its EndSession would open the
            # session again, to be held until the idle timeout.
            try:
                await rounds.aclose()
            finally:
                self.decoding -= 1
                self._end_request(gen, stats, place)
        yield self._finish(span, gen, stats, output)

    def _generation(self, request: ResolvedRequest) -> Generation:
        """The request's state for its rounds, in the mode it runs."""
        facts = self._ready_facts()
        mode = self._run_mode(request.mode)
        load = self._load(mode, request.sampling)
        if request.mode == AUTO and mode != OFF:  # the server picks: speculation only where it pays
            load = SpeculationGain(load)
        return Generation(
            session_id=uuid.uuid4().hex,
            committed=list(request.prompt_ids),
            sampling=request.sampling,
            mode=mode,
            num_speculative_tokens=request.num_speculative_tokens,
            max_support=self.config.max_support,
            return_logprobs=request.return_logprobs,
            max_len=min(facts.context_length, len(request.prompt_ids) + request.max_new_tokens),
            eos_token_ids=frozenset() if request.ignore_eos else facts.eos_token_ids,
            trace=RoundTrace(self.tracer, self.config.trace_max_round_spans),
            draft_wait=DraftWait(self.config.draft_wait_verifies, self.config.draft_wait_min_ms),
            load=load,
            payoff=self._payoff(mode, request.sampling, load),
        )

    def _load(self, mode: str, sampling: SamplingSettings) -> SpeculationLoad:
        """How a request speculates under load (coordinator/load.py). A seeded sampled sd request
        keeps its K at any load: which positions it drafts is part of what makes its output
        reproducible (README, "Calling Generate"). Greedy output does not depend on K, and ssd's
        already depends on timing."""
        if mode == SD and not sampling.greedy:
            return UNLIMITED
        return SpeculationLoad(self.config.speculation_max_running, lambda: self.decoding)

    def _payoff(self, mode: str, sampling: SamplingSettings, load: SpeculationLoad) -> SpeculationPayoff | None:
        """Greedy sd under load drafts the K that pays (coordinator/payoff.py); not where the
        load policy is off (--speculation-max-running 0: every request speculates as asked)."""
        if mode != SD or not sampling.greedy or self.config.speculation_max_running <= 0:
            return None
        return SpeculationPayoff(load, self.round_costs)

    def _rounds(self, gen: Generation) -> AsyncIterator[RoundResult]:
        """The request's round loop: ssd, or sd (which also runs target-only rounds)."""
        if gen.mode == SSD:
            # Round 0's verify is the prompt's prefill; the draft speculates beside it.
            return ssd_rounds(gen, self.target, self.draft, self.config)
        start_target_prefill(gen, self.target)
        return sd_rounds(gen, self.target, self.draft)

    async def _commit(self, gen: Generation, result: RoundResult, output: RequestOutput) -> Chunk:
        """A round's tokens up to the first stop condition, committed: the chunk they make final."""
        # One thread hop per round; the commit itself stays on the loop, beside the rounds' tasks.
        committed, stop_reason = await asyncio.get_running_loop().run_in_executor(
            self._pools["text"], settle_text, result.tokens, output.text, gen.eos_token_ids
        )
        gen.committed.extend(committed)
        logprobs = result.logprobs[: len(committed)] if gen.return_logprobs else []
        return output.commit(committed, logprobs, stop_reason, len(gen.committed) >= gen.max_len)

    def _end_request(self, gen: Generation, stats: RequestStats, place: Place | None) -> None:
        """Free what the request holds, however it ended (also cancelled: what ran is counted)."""
        drop_target_prefill(gen)
        gen.target_session.ended = gen.draft_session.ended = True
        ending = self._end_sessions(gen.session_id)
        if place is not None:
            place.release_after(ending)
        gen.trace.close()
        if self.metrics is not None:
            self.metrics.requests_in_flight.dec()
            self.metrics.observe_speculation(stats)

    def _finish(self, span: trace.Span, gen: Generation, stats: RequestStats, output: RequestOutput) -> Finish:
        """How the request ended, with its usage and stats; recorded on its span and metrics."""
        finish = output.finish(gen.committed[output.prompt_len:], stats.to_proto())
        completion = finish.usage.completion_tokens
        latency_s = time.perf_counter() - output.started
        if self.metrics is not None:
            self.metrics.observe_latency(output.first_token_s, latency_s, completion)
        ttft_ms = output.first_token_s * 1000.0 if output.first_token_s is not None else None
        record_response(span, finish.finish_reason, completion, finish.stats, ttft_ms, latency_s * 1000.0)
        return finish

    def _end_sessions(self, session_id: str) -> asyncio.Future:
        """Free the request's caches on both workers, without making the caller wait; the
        returned task is done once both have answered (or failed, or timed out)."""

        async def end() -> None:
            calls = [self.target.end_session(session_id)]
            if self.draft is not None:
                calls.append(self.draft.end_session(session_id))
            await asyncio.gather(*calls, return_exceptions=True)

        return asyncio.ensure_future(end())

    async def Generate(self, request, context):
        with llm_request(self.tracer, context, "Generate") as span:
            return await self._generate(request, context, trace_id_hex(span))

    async def GenerateStream(self, request, context):
        messages = llm_request_stream(
            self.tracer, context, "GenerateStream", lambda trace_id: self._generate_stream(request, context, trace_id)
        )
        async with contextlib.aclosing(messages):
            async for message in messages:
                yield message

    @contextlib.asynccontextmanager
    async def _admitted(self, request, context) -> AsyncIterator[tuple[ResolvedRequest, AsyncIterator[Chunk | Finish]]]:
        """The resolved request and its events, once it has a place (it may queue for one; the queue's wait
        ends at the call's deadline). While loading, UNAVAILABLE comes before any queueing."""
        self._ready_facts()
        await self._check(request)  # bad input is told so at once, not queued, nor told to retry
        async with self.admission.place(context.time_remaining()) as place:
            resolved = await self._resolve(request)
            # Closed here, not when collected: its sessions are ended before the place is let go.
            async with contextlib.aclosing(self.generate(resolved, place)) as events:
                yield resolved, events

    async def _generate(self, request, context, trace_id: str):
        try:
            async with self._admitted(request, context) as (resolved, events):
                async for event in events:
                    if isinstance(event, Finish):
                        return coordinator_pb2.GenerateResponse(
                            text=event.text,
                            token_ids=event.token_ids,
                            logprobs=event.logprobs,
                            **event.response_fields(resolved.request_id, trace_id),
                        )
        except Exception as exc:  # noqa: BLE001 - mapped to a status at the RPC edge
            await abort_on_error(context, exc)

    async def _generate_stream(self, request, context, trace_id: str):
        try:
            async with self._admitted(request, context) as (resolved, events):
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
        except Exception as exc:  # noqa: BLE001
            await abort_on_error(context, exc)

    async def ModelInfo(self, request, context):
        try:
            facts = self._ready_facts()
        except Exception as exc:  # noqa: BLE001
            await abort_on_error(context, exc)
        draft_info = self.draft.info if self.draft is not None else None
        return coordinator_pb2.ModelInfoResponse(
            target_model=facts.model,
            draft_model=draft_info.model if draft_info is not None else "",
            vocab_size=facts.vocab_size,
            context_length=facts.context_length,
            draft_available=draft_info is not None,
            tensor_parallel=facts.tensor_parallel,
            max_new_tokens_limit=self.config.max_new_tokens_limit,
            default_num_speculative_tokens=self.config.num_speculative_tokens,
        )
