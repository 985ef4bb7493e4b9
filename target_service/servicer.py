"""TargetWorker gRPC servicer: checks requests, runs them on the model thread."""

from __future__ import annotations

from specd.serving import InvalidRequest, ModelLoading, ModelThread, abort_on_error
from specd.telemetry import get_tracer, set_specd, worker_span
from specd.v1 import target_pb2, target_pb2_grpc
from specd.wire import check_session_id, check_committed, check_token_ids, sampling_from_proto, sampling_to_proto, sparse_from_proto
from target_service.outcomes import VerifyOutcomes
from target_service.runner import TargetModelRunner

_KIND = {True: target_pb2.NEXT_TOKEN_KIND_BONUS, False: target_pb2.NEXT_TOKEN_KIND_RECOVERED}


class TargetServicer(target_pb2_grpc.TargetWorkerServicer):
    def __init__(self, thread: ModelThread, tensor_parallel: int = 1):
        self._thread = thread
        self._tensor_parallel = tensor_parallel
        self.runner: TargetModelRunner | None = None  # set once the model is loaded
        self.tracer = get_tracer(None)  # the service's tracer and metrics, set by start_target
        self.metrics = None
        self._outcomes = VerifyOutcomes()  # what VerifyAfter waits on

    def _observe(self, op: str, forward_ms: float) -> None:
        if self.metrics is not None:
            self.metrics.observe_forward(op, forward_ms)

    def _ready_runner(self) -> TargetModelRunner:
        if self.runner is None:
            raise ModelLoading()
        return self.runner

    async def Prefill(self, request, context):
        try:
            runner = self._ready_runner()
            check_session_id(request.session_id)
            tokens = check_committed(request.committed, runner.loaded.vocab_size, runner.loaded.context_length, 0)
            cached, forward_ms = await self._thread.run(
                runner.prefill, request.session_id, request.committed.start, tokens
            )
            self._observe("prefill", forward_ms)
        except Exception as exc:  # noqa: BLE001 - mapped to a status at the RPC edge
            await abort_on_error(context, exc)
        return target_pb2.TargetPrefillResponse(cached_tokens=cached, forward_ms=forward_ms)

    async def Verify(self, request, context):
        try:
            response = await self._verify(request)
        except Exception as exc:  # noqa: BLE001
            await abort_on_error(context, exc)
        return response

    async def VerifyAfter(self, request, context):
        try:
            self._ready_runner()
            check_session_id(request.session_id)
            for i, choice in enumerate(request.choices):
                if choice.verify.session_id != request.session_id or choice.verify.committed.start != request.after:
                    raise InvalidRequest(
                        f"choices[{i}].verify must continue session {request.session_id!r} at position {request.after}"
                    )
            outcome = await self._outcomes.wait(request.session_id, request.after)
            chosen = next((c for c in request.choices if (c.accepted, c.next_token) == outcome), None)
            response = target_pb2.VerifyAfterResponse(matched=False)
            if chosen is not None:
                response = target_pb2.VerifyAfterResponse(matched=True, verify=await self._verify(chosen.verify))
        except Exception as exc:  # noqa: BLE001
            await abort_on_error(context, exc)
        return response

    async def _verify(self, request) -> target_pb2.VerifyResponse:
        """Check a VerifyRequest, run it on the model thread, record its outcome."""
        runner = self._ready_runner()
        loaded = runner.loaded
        check_session_id(request.session_id)
        num_draft = len(request.draft_tokens)
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
        with worker_span(
            self.tracer, "spec_verify", tokens_verified=num_draft + 1, new_committed_tokens=len(tokens)
        ) as span:
            outcome = await self._thread.run(
                runner.verify,
                request.session_id,
                request.committed.start,
                tokens,
                draft_tokens,
                dists,
                sampling,
                request.return_logprobs,
            )
            # First: a verify sent ahead for this outcome starts before this one answers.
            committed = request.committed.start + len(tokens)
            self._outcomes.record(request.session_id, committed, (outcome.accepted, outcome.next_token))
            set_specd(span, forward_ms=outcome.forward_ms, accepted=outcome.accepted, bonus=outcome.is_bonus)
        self._observe("verify", outcome.forward_ms)
        return target_pb2.VerifyResponse(
            accepted=outcome.accepted,
            next_token=outcome.next_token,
            next_token_kind=_KIND[outcome.is_bonus],
            logprobs=outcome.logprobs,
            forward_ms=outcome.forward_ms,
            cached_tokens=outcome.cached_tokens,
        )

    async def EndSession(self, request, context):
        try:
            runner = self._ready_runner()
            self._outcomes.forget(request.session_id)
            existed = await self._thread.run(runner.end_session, request.session_id)
        except Exception as exc:  # noqa: BLE001
            await abort_on_error(context, exc)
        return target_pb2.TargetEndSessionResponse(existed=existed)

    async def Info(self, request, context):
        try:
            loaded = self._ready_runner().loaded
        except Exception as exc:  # noqa: BLE001
            await abort_on_error(context, exc)
        return target_pb2.TargetInfo(
            model=loaded.name,
            vocab_size=loaded.vocab_size,
            context_length=loaded.context_length,
            eos_token_ids=list(loaded.eos_token_ids),
            default_sampling=sampling_to_proto(loaded.default_sampling),
            dtype=loaded.dtype,
            device=loaded.device,
            tensor_parallel=self._tensor_parallel,
            tokenizer_fingerprint=loaded.tokenizer_fingerprint,
        )
