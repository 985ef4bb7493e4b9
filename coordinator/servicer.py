"""Coordinator gRPC servicer: Generate (unary and streaming) and ModelInfo."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import dataclasses
import logging
import time
import uuid
from typing import AsyncIterator

from opentelemetry import trace

from coordinator.config import CoordinatorConfig
from coordinator.draft_wait import DraftWait
from coordinator.request import ResolvedRequest, TargetFacts, resolve
from coordinator.rounds import Generation, drop_target_prefill, sd_rounds, start_target_prefill
from coordinator.ssd_rounds import ssd_rounds
from coordinator.round_trace import RoundTrace, llm_request, llm_request_stream, record_request, record_response
from coordinator.stats import RequestStats
from coordinator.text import TextAssembler
from coordinator.workers import DraftLink, TargetLink
from specd.serving import ModelLoading, abort_on_error
from specd.telemetry import get_tracer, trace_id_hex
from specd.v1 import coordinator_pb2, coordinator_pb2_grpc

log = logging.getLogger(__name__)


@dataclasses.dataclass
class Chunk:
    """Tokens committed by one round, and the text that became final with them."""

    token_ids: list[int]
    logprobs: list[float]
    text: str


@dataclasses.dataclass
class Finish:
    finish_reason: int
    stop_reason: str
    text: str  # the whole generated text
    token_ids: list[int]
    logprobs: list[float]
    usage: coordinator_pb2.Usage
    stats: coordinator_pb2.SpeculationStats


def _settle_text(tokens: list[int], text: TextAssembler, eos_ids: frozenset[int]) -> tuple[list[int], str]:
    """Add a round's tokens to the text up to the first stop condition; (tokens to commit, stop reason).

    Runs on a text thread: it decodes, whose cost grows with the tokens and stop strings."""
    for count, token in enumerate(tokens, 1):
        if text.add(token):
            return tokens[:count], text.stop_string
        if token in eos_ids:
            return tokens[:count], "eos"
    return tokens, ""


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
        facts = self._ready_facts()
        pool = self._pools["large-prompt" if request.ByteSize() > _LARGE_REQUEST_BYTES else "prompt"]
        return await asyncio.get_running_loop().run_in_executor(pool, resolve, request, facts, self.config)

    def _ready_facts(self) -> TargetFacts:
        if self.facts is None:
            raise ModelLoading(f"the coordinator is waiting for the target worker at {self.target.address}")
        return self.facts

    def _run_mode(self, asked: str) -> str:
        mode = self.config.default_mode if asked == "auto" else asked
        if mode == "auto":
            mode = "ssd" if self.draft is not None else "off"
        return mode

    async def generate(self, request: ResolvedRequest) -> AsyncIterator[Chunk | Finish]:
        started = time.perf_counter()
        first_token_s = None
        span = trace.get_current_span()  # llm_request
        record_request(span, request)
        facts = self._ready_facts()
        mode = self._run_mode(request.mode)
        prompt_len = len(request.prompt_ids)
        eos_ids = frozenset() if request.ignore_eos else facts.eos_token_ids
        gen = Generation(
            session_id=uuid.uuid4().hex,
            committed=list(request.prompt_ids),
            sampling=request.sampling,
            mode=mode,
            num_speculative_tokens=request.num_speculative_tokens,
            max_support=self.config.max_support,
            return_logprobs=request.return_logprobs,
            max_len=min(facts.context_length, prompt_len + request.max_new_tokens),
            eos_token_ids=eos_ids,
            trace=RoundTrace(self.tracer, self.config.trace_max_round_spans),
            draft_wait=DraftWait(self.config.draft_wait_verifies, self.config.draft_wait_min_ms),
        )
        stats = RequestStats(requested_mode=mode, seed=request.sampling.seed)
        text = TextAssembler(facts.tokenizer, request.prompt_ids, request.stop_strings)
        logprobs: list[float] = []
        streamed = 0
        finish_reason, stop_reason = coordinator_pb2.FINISH_REASON_LENGTH, ""
        if self.metrics is not None:
            self.metrics.requests_in_flight.inc()
        try:
            if mode == "ssd":
                # Round 0's verify is the prompt's prefill; the draft speculates beside it.
                rounds = ssd_rounds(gen, self.target, self.draft, self.config)
            else:
                start_target_prefill(gen, self.target)
                rounds = sd_rounds(gen, self.target, self.draft)
            loop = asyncio.get_running_loop()
            async for result in rounds:
                stats.add(result)
                # One thread hop per round; the commit itself stays on the loop, beside the rounds' tasks.
                committed, stop_reason = await loop.run_in_executor(self._pools["text"], _settle_text, result.tokens, text, eos_ids)
                gen.committed.extend(committed)
                if stop_reason:
                    finish_reason = coordinator_pb2.FINISH_REASON_STOP
                chunk_logprobs = result.logprobs[: len(committed)] if request.return_logprobs else []
                logprobs.extend(chunk_logprobs)
                done = bool(stop_reason) or len(gen.committed) >= gen.max_len
                end = len(text.text) if done else text.streamable_length()
                if first_token_s is None and committed:
                    first_token_s = time.perf_counter() - started
                yield Chunk(committed, chunk_logprobs, text.text[streamed:end])
                streamed = max(streamed, end)
                if done:
                    await rounds.aclose()
                    break
        finally:
            drop_target_prefill(gen)
            self._end_sessions(gen.session_id)
            gen.trace.close()
            if self.metrics is not None:
                self.metrics.requests_in_flight.dec()
                self.metrics.observe_speculation(stats)  # what ran, also for a cancelled request
        completion = len(gen.committed) - prompt_len
        latency_s = time.perf_counter() - started
        stats_proto = stats.to_proto()
        if self.metrics is not None:
            self.metrics.observe_latency(first_token_s, latency_s, completion)
        ttft_ms = first_token_s * 1000.0 if first_token_s is not None else None
        record_response(span, finish_reason, completion, stats_proto, ttft_ms, latency_s * 1000.0)
        yield Finish(
            finish_reason=finish_reason,
            stop_reason=stop_reason,
            text=text.text,
            token_ids=gen.committed[prompt_len:],
            logprobs=logprobs,
            usage=coordinator_pb2.Usage(
                prompt_tokens=prompt_len, completion_tokens=completion, total_tokens=prompt_len + completion
            ),
            stats=stats_proto,
        )

    def _end_sessions(self, session_id: str) -> None:
        """Free the request's caches on both workers, without making the caller wait."""

        async def end() -> None:
            calls = [self.target.end_session(session_id)]
            if self.draft is not None:
                calls.append(self.draft.end_session(session_id))
            await asyncio.gather(*calls, return_exceptions=True)

        asyncio.ensure_future(end())

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

    async def _generate(self, request, context, trace_id: str):
        try:
            resolved = await self._resolve(request)
            async for event in self.generate(resolved):
                if isinstance(event, Finish):
                    return coordinator_pb2.GenerateResponse(
                        text=event.text,
                        token_ids=event.token_ids,
                        finish_reason=event.finish_reason,
                        stop_reason=event.stop_reason,
                        usage=event.usage,
                        stats=event.stats,
                        logprobs=event.logprobs,
                        request_id=resolved.request_id,
                        trace_id=trace_id,
                    )
        except Exception as exc:  # noqa: BLE001 - mapped to a status at the RPC edge
            await abort_on_error(context, exc)

    async def _generate_stream(self, request, context, trace_id: str):
        try:
            resolved = await self._resolve(request)
            async for event in self.generate(resolved):
                if isinstance(event, Chunk):
                    if event.token_ids or event.text:
                        yield coordinator_pb2.GenerateStreamResponse(
                            text=event.text,
                            token_ids=event.token_ids,
                            logprobs=event.logprobs,
                            request_id=resolved.request_id,
                            trace_id=trace_id,
                        )
                else:
                    yield coordinator_pb2.GenerateStreamResponse(
                        finish_reason=event.finish_reason,
                        stop_reason=event.stop_reason,
                        usage=event.usage,
                        stats=event.stats,
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
