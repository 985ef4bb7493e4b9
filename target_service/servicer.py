"""TargetWorker gRPC servicer: checks requests, runs them on the model thread."""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import time

from specd.core.errors import InvalidRequest, SessionNotFound
from specd.core.outcomes import outcome_of
from specd.engine.batcher import Again, Batcher
from specd.observability.telemetry import set_specd, worker_span
from specd.serving.model_thread import ModelThread
from specd.serving.status import rpc_edge
from specd.v1 import target_pb2, target_pb2_grpc
from specd.wire.checks import check_committed, check_token_ids
from specd.wire.convert import sampling_from_proto, sampling_to_proto, sparse_from_proto, tokenizer_spec_to_proto
from specd.wire.outcomes import choices_by_outcome
from specd.worker.servicer import WorkerServicer, common_info
from target_service.calls import PrefillCall, VerifyCall
from target_service.prefill_pacing import PrefillPacer
from target_service.runner import ForwardCost, TargetModelRunner
from target_service.verify_after import VerifyOutcomes
from target_service.verify_decision import VerifyOutcome

_KIND = {True: target_pb2.NEXT_TOKEN_KIND_BONUS, False: target_pb2.NEXT_TOKEN_KIND_RECOVERED}
# Most draft tokens one verify may carry: twice the coordinator's largest K (32). Without a bound
# one call of thousands of tokens would hold every session's forwards behind its own and build
# logits of gigabytes.
MAX_VERIFY_DRAFT_TOKENS = 64


@dataclasses.dataclass(frozen=True)
class _Timed:
    """A verify's outcome with the wall-clock times it ran between (for its span)."""

    outcome: VerifyOutcome
    call: VerifyCall
    started_ns: int
    ended_ns: int


class TargetServicer(WorkerServicer, target_pb2_grpc.TargetWorkerServicer):
    prefill_response = target_pb2.TargetPrefillResponse
    end_session_response = target_pb2.TargetEndSessionResponse

    def __init__(
        self,
        thread: ModelThread,
        verify_after_wait_s: float,
        tensor_parallel: int = 1,
        max_batch_size: int = 16,
        batch_wait_ms: float = 0.0,
        retired_session_memory_s: float = 30.0,
        prefill_pacer: PrefillPacer | None = None,
    ):
        super().__init__(thread, retired_session_memory_s)
        self._pacer = prefill_pacer or PrefillPacer(0.0, 0)  # the tokens each forward may feed, from its time budget
        self._tensor_parallel = tensor_parallel
        self._verify_after_wait_s = verify_after_wait_s  # the longest a VerifyAfter waits (TargetConfig)
        self._verifying: collections.Counter[str] = collections.Counter()  # Verify calls in flight per session
        # Verifies of different sessions ready together share a forward; a verify sent ahead
        # (VerifyAfter) joins the batch right after the verify it follows.
        self._batcher = Batcher(thread.submit, self._run_batch, lambda item: item.session_id, max_batch_size, batch_wait_ms / 1000.0)
        self._outcomes = VerifyOutcomes(self._batcher.enqueue)

    def _info(self, runner) -> target_pb2.TargetInfo:
        loaded, spec = runner.loaded, runner.tokenizer_spec
        return target_pb2.TargetInfo(
            **common_info(loaded),
            eos_token_ids=list(loaded.eos_token_ids),
            default_sampling=sampling_to_proto(loaded.default_sampling),
            tensor_parallel=self._tensor_parallel,
            tokenizer=tokenizer_spec_to_proto(spec) if spec is not None else None,  # the coordinator tokenises with it
        )

    def _forget(self, session_id: str) -> None:
        self._outcomes.forget(session_id)  # verifies sent ahead for it never run
        self._batcher.forget(session_id)  # batches do not wait for its calls

    @rpc_edge
    async def Verify(self, request, context):
        runner = self._ready_runner()
        # Checked here, with no await before it counts as verifying: a VerifyAfter sent right
        # behind it must find its session known. (At most MAX_VERIFY_DRAFT_TOKENS draft_probs.)
        call = self._prepare(runner, request)
        self._check_room(runner, request)
        self._verifying[call.session_id] += 1  # a VerifyAfter may follow it
        try:
            with worker_span(
                self.tracer, "spec_verify", tokens_verified=call.num_draft + 1, new_committed_tokens=len(call.tokens)
            ) as span:
                timed = await asyncio.wrap_future(self._batcher.submit(call))
                set_specd(span, forward_ms=timed.outcome.forward_ms, accepted=timed.outcome.accepted, bonus=timed.outcome.is_bonus)
        finally:
            self._verifying[call.session_id] -= 1
            if not self._verifying[call.session_id]:
                del self._verifying[call.session_id]
        return self._response(timed.outcome)

    @rpc_edge
    async def VerifyAfter(self, request, context):
        self._check_verify_after(self._ready_runner(), request)
        timed = await self._wait_for_choice(request)
        if timed is None:
            return target_pb2.VerifyAfterResponse(matched=False)
        self._record_span(timed)
        return target_pb2.VerifyAfterResponse(matched=True, verify=self._response(timed.outcome))

    def _check_verify_after(self, runner: TargetModelRunner, request) -> None:
        """A VerifyAfter's choices continue its session where it says, in a session this worker
        knows: one that waited on a verify never sent would wait for good."""
        self._check_open_session_id(request.session_id)
        for i, choice in enumerate(request.choices):
            if choice.verify.session_id != request.session_id or choice.verify.committed.start != request.after:
                raise InvalidRequest(
                    f"choices[{i}].verify must continue session {request.session_id!r} at position {request.after}"
                )
        known = (
            request.session_id in self._verifying
            or request.session_id in runner.sessions
            or self._outcomes.knows(request.session_id)
        )
        if not known:
            raise SessionNotFound(f"session {request.session_id!r} is not on this worker: nothing to verify after")

    async def _wait_for_choice(self, request) -> _Timed | None:
        """The chosen verify's result once the verify it follows has run; None when nothing ran
        (no choice for its outcome, the session moved on or ended, or the wait's bound passed)."""
        # Checked in full only once chosen, on the model thread (most choices never run).
        choices = choices_by_outcome(request.choices)
        waiter = self._outcomes.expect(request.session_id, request.after, choices)
        answer = asyncio.wrap_future(waiter.answer)
        try:
            done, _ = await asyncio.wait({answer}, timeout=self._verify_after_wait_s)
        except asyncio.CancelledError:
            self._outcomes.discard(request.session_id, waiter)
            answer.cancel()  # a choice already running goes on; its result is nobody's
            raise
        if not done:
            self._outcomes.discard(request.session_id, waiter)  # a choice already running goes on
            if waiter.answer.cancelled():
                return None
        return await answer

    def _prepare(self, runner: TargetModelRunner, request) -> VerifyCall:
        """A VerifyRequest checked against the model, as the runner takes it."""
        loaded = runner.loaded
        self._check_open_session_id(request.session_id)
        num_draft = len(request.draft_tokens)
        if num_draft > MAX_VERIFY_DRAFT_TOKENS:
            raise InvalidRequest(f"draft_tokens holds {num_draft} tokens; a verify takes at most {MAX_VERIFY_DRAFT_TOKENS}")
        tokens = check_committed(request.committed, loaded.vocab_size, loaded.context_length, num_draft)
        draft_tokens = check_token_ids(request.draft_tokens, loaded.vocab_size, "draft_tokens")
        sampling = sampling_from_proto(request.sampling, loaded.default_sampling)
        dists = []
        if not sampling.greedy:
            if len(request.draft_probs) != num_draft:
                raise InvalidRequest(f"draft_probs has {len(request.draft_probs)} entries for {num_draft} draft tokens")
            for i, (token, message) in enumerate(zip(draft_tokens, request.draft_probs)):
                dist = sparse_from_proto(message, loaded.vocab_size, f"draft_probs[{i}]")
                if not any(t == token and p > 0 for t, p in zip(dist.token_ids, dist.probs)):
                    raise InvalidRequest(f"draft_tokens[{i}] is not in the support of draft_probs[{i}]")
                dists.append(dist)
        return VerifyCall(
            request.session_id, request.committed.start, tokens, draft_tokens, dists, sampling, request.return_logprobs,
            request.committed.reserve_tokens,
        )

    @rpc_edge
    async def Prefill(self, request, context):
        """The prompt's prefill, batched with the verifies and prefills of other sessions."""
        runner = self._ready_runner()
        self._check_open_session_id(request.session_id)
        tokens = check_committed(request.committed, runner.loaded.vocab_size, runner.loaded.context_length, 0)
        call = PrefillCall(request.session_id, request.committed.start, tokens, request.committed.reserve_tokens)
        self._check_room(runner, request)  # a refusal takes no place in a forward
        cached, forward_ms = await asyncio.wrap_future(self._batcher.submit(call))
        return self.prefill_response(cached_tokens=cached, forward_ms=forward_ms)

    def _run_batch(self, items: list) -> list:
        """On the model thread: one forward for a batch of prefills and verifies (VerifyCalls, and
        requests sent ahead whose outcome came, checked only now), each verify's outcome recorded
        at once so that a verify sent ahead for it joins the next batch."""
        runner = self._ready_runner()
        results: list = [None] * len(items)
        calls: dict[int, VerifyCall | PrefillCall] = {}
        for i, item in enumerate(items):
            try:
                calls[i] = item if isinstance(item, (VerifyCall, PrefillCall)) else self._prepare(runner, item)
            except Exception as exc:  # noqa: BLE001 - this call alone fails
                results[i] = exc
        started_ns = time.time_ns()
        outcomes = runner.run_batch(list(calls.values()), self._most_tokens(runner, calls.values()))
        ended_ns = time.time_ns()
        if runner.last_forward is not None:
            self._pacer.observe(runner.last_forward)
        for (i, call), outcome in zip(calls.items(), outcomes):
            if isinstance(outcome, VerifyOutcome):
                committed = call.start + len(call.tokens)
                self._outcomes.record(call.session_id, committed, outcome_of(outcome))
                outcome = _Timed(outcome, call, started_ns, ended_ns)
            results[i] = outcome
        self._observe_forward(results, runner.last_forward)
        return results

    def _most_tokens(self, runner, calls) -> int | None:
        """The pacer's limit on the forward's tokens while it serves more than one session (the
        others' next calls must not wait long); a session alone on the worker caches its prompt
        as fast as it can."""
        own = {call.session_id for call in calls}
        sessions = len(runner.sessions) - sum(session_id in runner.sessions for session_id in own) + len(own)
        return self._pacer.most_tokens() if sessions > 1 else None

    def _observe_forward(self, results: list, forward: ForwardCost | None) -> None:
        """The batch's forward, if one ran, in the metrics: as a verify if it verified anything,
        else as a prefill (prompts cached whole, or a chunk of them to run again)."""
        if forward is None:
            return
        timed = sum(isinstance(r, _Timed) for r in results)
        prefilled = sum(isinstance(r, tuple) for r in results)
        chunks = sum(isinstance(r, Again) for r in results)  # calls that cached a chunk, to run again
        self._observe("verify" if timed else "prefill", forward.ms, batch_size=timed + prefilled + chunks)

    def _record_span(self, timed: _Timed) -> None:
        """The spec_verify span of a verify run on the model thread at the times it ran."""
        span = self.tracer.start_span("spec_verify", start_time=timed.started_ns)
        set_specd(
            span, tokens_verified=timed.call.num_draft + 1, new_committed_tokens=len(timed.call.tokens),
            forward_ms=timed.outcome.forward_ms, accepted=timed.outcome.accepted, bonus=timed.outcome.is_bonus,
        )
        span.end(end_time=timed.ended_ns)

    @staticmethod
    def _response(outcome: VerifyOutcome) -> target_pb2.VerifyResponse:
        return target_pb2.VerifyResponse(
            accepted=outcome.accepted,
            next_token=outcome.next_token,
            next_token_kind=_KIND[outcome.is_bonus],
            logprobs=outcome.logprobs,
            forward_ms=outcome.forward_ms,
            cached_tokens=outcome.cached_tokens,
        )
