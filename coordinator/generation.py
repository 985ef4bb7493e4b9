"""One request's life on the coordinator: its state and policy, its rounds, each round's tokens
committed as text, its stats, and its sessions ended however it ends.

    Generator.run(request, place)
      RequestState + SpeculationPolicy        coordinator/request_state.py, coordinator/policy.py
      ssd_rounds | sd_rounds                   coordinator/ssd_rounds.py, coordinator/sd_rounds.py
        RoundsAhead: each round's tokens committed (to an EOS), the next round started   coordinator/rounds_ahead.py
        each RoundAhead -> stats, text settled (stop strings, EOS, max length) -> Chunk
      Finish (text, usage, stats), sessions ended, place released
      RequestRecord: a finished request logged and counted  coordinator/request_log.py
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
import uuid
from typing import AsyncIterator, Callable

from opentelemetry import trace

from coordinator.admission import Place
from coordinator.config import CoordinatorConfig
from coordinator.draft_link import DraftLink
from coordinator.draft_wait import DraftWait
from coordinator.output import Chunk, Finish, RequestOutput, settle_text
from coordinator.policy import SpeculationPolicy
from coordinator.policy_measures import RoundCosts
from coordinator.profiles import SpeculationProfile
from coordinator.request import ResolvedRequest, TargetFacts
from coordinator.request_log import RequestRecord
from coordinator.request_state import RequestState
from coordinator.round_result import RoundResult
from coordinator.round_trace import RoundTrace, record_request, record_response
from coordinator.rounds_ahead import RoundAhead, RoundsAhead
from coordinator.sd_rounds import sd_rounds
from coordinator.ssd_rounds import ssd_rounds
from coordinator.stats import RequestStats
from coordinator.target_link import TargetLink
from coordinator.text import TextAssembler
from specd.observability.telemetry import trace_id_hex
from specd.wire.modes import AUTO, OFF, SSD


class Generator:
    """Runs requests against one target (and draft), sharing what requests share: the round
    costs the policy measures, the count of requests in their rounds, the text threads."""

    def __init__(
        self,
        config: CoordinatorConfig,
        target: TargetLink,
        draft: DraftLink | None,
        text_pool: concurrent.futures.Executor,
        tracer: trace.Tracer,
        metrics=None,
    ):
        self.config, self.target, self.draft = config, target, draft
        self.text_pool = text_pool
        self.tracer = tracer
        self.metrics = metrics  # the coordinator's CoordinatorMetrics (None in some tests)
        self.round_costs = RoundCosts()  # what sd rounds cost now, measured across requests
        # Requests in their rounds now: what speculation under load counts. Not the admitted
        # places, which a request holds until its EndSession calls are answered: the request
        # after it would find one more running than decodes beside it.
        self.decoding = 0
        self.running: Callable[[], int] = lambda: self.decoding

    def run_mode(self, asked: str) -> str:
        """ssd, sd or off for a request that asked `asked` (auto: the configured default, then
        ssd with a draft worker configured, else off)."""
        mode = self.config.default_mode if asked == AUTO else asked
        if mode == AUTO:
            mode = SSD if self.draft is not None else OFF
        return mode

    async def run(
        self,
        request: ResolvedRequest,
        facts: TargetFacts,
        profile: SpeculationProfile,
        place: Place | None = None,
        record: RequestRecord | None = None,
    ) -> AsyncIterator[Chunk | Finish]:
        """A request's life: its rounds, each round's tokens committed as text, then how it ended.
        `place`, its admission, is released once its worker sessions are ended. `record`, the
        front's, is filled in as the request runs; a finished request is logged and counted
        here, one that fails is left to the front (which tells its caller how it ended)."""
        record = record if record is not None else RequestRecord()
        text = TextAssembler(facts.tokenizer, request.prompt_ids, request.stop_strings)
        # Latencies count from the call's arrival (the record's start), queueing and tokenising included.
        output = RequestOutput(text, prompt_len=len(request.prompt_ids), started=record.started)
        span = trace.get_current_span()  # llm_request
        record_request(span, request)
        state = self._state(request, facts, profile)
        stats = RequestStats(requested_mode=state.mode, seed=request.sampling.seed)
        record.request_id, record.prompt_tokens = request.request_id, output.prompt_len
        record.trace_id = record.trace_id or trace_id_hex(span)
        stats.queue_ms = place.queue_ms if place is not None else 0.0
        if self.metrics is not None:
            self.metrics.requests_in_flight.inc()
        rounds: RoundsAhead | None = None
        settled = len(state.committed)  # committed tokens whose text is settled: the request's output
        self.decoding += 1
        try:
            # Before any round: while the target is full, the request waits for its session here.
            await self.target.open_session(state.target_session, state.committed)
            rounds = RoundsAhead(self._rounds(state), state)
            async for ahead in rounds:
                stats.add(ahead.result)
                chunk = await self._commit(state, ahead, output)
                settled = ahead.start + len(chunk.token_ids)
                yield chunk
                if output.done:
                    break
        finally:
            # Closed before the sessions are ended: the round under way, ahead of the text, has
            # calls in flight, and one reaching the draft after its EndSession would open the
            # session again, to be held until the idle timeout.
            try:
                if rounds is not None:
                    await rounds.close()
            finally:
                del state.committed[settled:]  # rounds ahead of a stop string, or of a cancelled request's last chunk
                self.decoding -= 1
                record.add_stats(stats, len(state.committed) - output.prompt_len)
                self._end_request(state, stats, place)
        yield self._finish(span, state, stats, output, record)

    def _state(self, request: ResolvedRequest, facts: TargetFacts, profile: SpeculationProfile) -> RequestState:
        """The request's state for its rounds, in the mode it runs, with its policy."""
        mode = self.run_mode(request.mode)
        policy = SpeculationPolicy(
            mode,
            request.num_speculative_tokens,
            request.sampling,
            profile,
            running=self.running,
            costs=self.round_costs,
            auto=request.mode == AUTO,  # the server picks: speculation only where it pays
        )
        return RequestState(
            session_id=uuid.uuid4().hex,
            committed=list(request.prompt_ids),
            sampling=request.sampling,
            policy=policy,
            max_support=self.config.max_support,
            return_logprobs=request.return_logprobs,
            max_len=min(facts.context_length, len(request.prompt_ids) + request.max_new_tokens),
            eos_token_ids=frozenset() if request.ignore_eos else facts.eos_token_ids,
            trace=RoundTrace(self.tracer, self.config.trace_max_round_spans),
            draft_wait=DraftWait(self.config.draft_wait_verifies, self.config.draft_wait_min_ms),
        )

    def _rounds(self, state: RequestState) -> AsyncIterator[RoundResult]:
        """The request's round loop: ssd, or sd (which also runs target-only rounds)."""
        if state.mode == SSD:
            # Round 0's verify is the prompt's prefill; the draft speculates beside it.
            return ssd_rounds(state, self.target, self.draft, self.config)
        return sd_rounds(state, self.target, self.draft)

    async def _commit(self, state: RequestState, ahead: RoundAhead, output: RequestOutput) -> Chunk:
        """A round's tokens up to the first stop condition, their text settled: the chunk they make final."""
        # One thread hop per round, while the next round runs; the commit itself stays on the loop.
        settled, stop_reason = await asyncio.get_running_loop().run_in_executor(
            self.text_pool, settle_text, ahead.tokens, output.text, state.eos_token_ids
        )
        logprobs = ahead.result.logprobs[: len(settled)] if state.return_logprobs else []
        return output.commit(settled, logprobs, stop_reason, ahead.start + len(settled) >= state.max_len)

    def _end_request(self, state: RequestState, stats: RequestStats, place: Place | None) -> None:
        """Free what the request holds, however it ended (also cancelled: what ran is counted)."""
        state.drop_target_prefill()
        state.target_session.ended = state.draft_session.ended = True
        ending = self._end_sessions(state.session_id)
        if place is not None:
            place.release_after(ending)
        state.trace.close()
        if self.metrics is not None:
            self.metrics.requests_in_flight.dec()
            self.metrics.observe_speculation(stats)

    def _finish(
        self, span: trace.Span, state: RequestState, stats: RequestStats, output: RequestOutput, record: RequestRecord
    ) -> Finish:
        """How the request ended, with its usage and stats; recorded on its span, metrics and log."""
        finish = output.finish(state.committed[output.prompt_len :], stats.to_proto())
        completion = finish.usage.completion_tokens
        latency_s = time.perf_counter() - output.started
        if self.metrics is not None:
            self.metrics.observe_latency(output.first_token_s, latency_s, completion)
        record.finished(self.metrics, finish.finish_reason)
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
