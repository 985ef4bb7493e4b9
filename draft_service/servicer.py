"""DraftWorker gRPC servicer: checks requests, runs them on the model thread."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import threading

from draft_service.runner import DraftModelRunner
from draft_service.speculation import SpeculationCancelled, SpeculationResult
from specd.core.errors import InvalidRequest
from specd.core.sampling import SamplingSettings
from specd.engine.step_batcher import StepBatcher
from specd.observability.telemetry import set_specd, worker_span
from specd.serving.model_thread import ModelThread
from specd.serving.status import rpc_edge
from specd.v1 import draft_pb2, draft_pb2_grpc
from specd.wire.checks import check_committed, check_token_ids
from specd.wire.convert import sampling_from_proto, sparse_to_proto
from specd.worker.servicer import WorkerServicer, common_info


@dataclasses.dataclass(frozen=True)
class _SpeculateCall:
    """A checked SpeculateRequest, in the runner's terms."""

    runner: DraftModelRunner
    tokens: list[int]  # the committed tail
    draft_tokens: list[int]
    fanout: list[int]
    sampling: SamplingSettings
    saguaro: tuple[float, list[int]]


class DraftServicer(WorkerServicer, draft_pb2_grpc.DraftWorkerServicer):
    prefill_response = draft_pb2.DraftPrefillResponse
    end_session_response = draft_pb2.DraftEndSessionResponse

    def __init__(
        self,
        thread: ModelThread,
        max_branches: int,
        max_depth: int,
        max_batch_size: int = 16,
        batch_wait_ms: float = 0.0,
        retired_session_memory_s: float = 30.0,
    ):
        """max_branches: most branches per Speculate; max_depth: most draft tokens per Propose,
        per Speculate branch, and verified beside one Speculate; max_batch_size: most sessions
        one forward serves (DraftConfig)."""
        super().__init__(thread, retired_session_memory_s)
        self._max_branches = max_branches
        self._max_depth = max_depth
        self._max_batch_size = max_batch_size
        self._batch_wait_s = batch_wait_ms / 1000.0
        self._steps: StepBatcher | None = None  # once the model is loaded: it needs the model's packer

    def _step_batcher(self, runner: DraftModelRunner) -> StepBatcher:
        """Proposes and Speculates of different sessions share forwards, step by step."""
        if self._steps is None:
            self._steps = StepBatcher(self._thread.submit, runner.packer, self._max_batch_size, self._observe_step, self._batch_wait_s)
        return self._steps

    def _forget(self, session_id: str) -> None:
        if self._steps is not None:
            self._steps.forget(session_id)  # turns do not wait for its calls

    def _observe_step(self, batch_size: int, forward_ms: float) -> None:
        """One forward of the step batcher: how many sessions it served (its time is in each call's)."""
        if self.metrics is not None:
            self.metrics.observe_batch("step", batch_size)

    def _info(self, runner) -> draft_pb2.DraftInfo:
        return draft_pb2.DraftInfo(**common_info(runner.loaded))

    async def _traced(self, name: str, call, result_attributes, **attributes):
        """Await a model call inside a worker span (spec_propose, spec_speculate); the span
        gets `attributes` before and result_attributes(result) after, all as specd.*."""
        with worker_span(self.tracer, name, **attributes) as span:
            result = await call
            set_specd(span, **result_attributes(result))
        self._observe(name.removeprefix("spec_"), result.forward_ms)
        return result

    @rpc_edge
    async def Propose(self, request, context):
        runner = self._ready_runner()
        loaded = runner.loaded
        self._check_open_session_id(request.session_id)
        if not 1 <= request.num_tokens <= self._max_depth:
            raise InvalidRequest(f"num_tokens must lie in [1, {self._max_depth}], got {request.num_tokens}")
        tokens = check_committed(request.committed, loaded.vocab_size, loaded.context_length, request.num_tokens)
        sampling = sampling_from_proto(request.sampling, loaded.default_sampling)
        self._check_room(runner, request)
        job = functools.partial(
            runner.propose_job,
            request.session_id,
            request.committed.start,
            tokens,
            request.num_tokens,
            sampling,
            request.max_support,
            *_saguaro(request.saguaro),
            reserve_tokens=request.committed.reserve_tokens,
        )
        run = asyncio.wrap_future(self._step_batcher(runner).start(job, request.session_id))
        proposal = await self._traced("spec_propose", run, lambda p: {"forward_ms": p.forward_ms}, num_tokens=request.num_tokens)
        return draft_pb2.ProposeResponse(
            draft_tokens=proposal.draft_tokens,
            draft_probs=[sparse_to_proto(d) for d in proposal.draft_dists],
            forward_ms=proposal.forward_ms,
        )

    @rpc_edge
    async def Speculate(self, request, context):
        """Streams the branches' (k, t*) as soon as step 0 has run, then the whole cache."""
        # Cancelling the call (the coordinator stopped waiting) stops the build between steps;
        # the model thread is then free for the next Propose or Speculate.
        cancel = threading.Event()
        job: asyncio.Future | None = None
        try:
            call = self._check_speculate(request)
            guesses: asyncio.Queue = asyncio.Queue()
            job = self._start_build(request, call, cancel, guesses)
            roots = await _first_guesses(job, guesses)
            if roots is not None:
                yield draft_pb2.SpeculateResponse(
                    guesses=draft_pb2.SpeculationGuesses(accepted=[j for j, _ in roots], next_token=[g for _, g in roots])
                )
            result = await job
        except (asyncio.CancelledError, GeneratorExit):
            _stop_build(cancel, job)
            raise
        except SpeculationCancelled:  # the build saw the caller go first: the call is cancelled
            _stop_build(cancel, job)
            raise asyncio.CancelledError() from None
        yield draft_pb2.SpeculateResponse(cache=_cache_message(result))

    def _check_speculate(self, request) -> _SpeculateCall:
        runner = self._ready_runner()
        loaded = runner.loaded
        self._check_open_session_id(request.session_id)
        draft_tokens, fanout = self._check_speculate_size(request, loaded.vocab_size)
        tokens = check_committed(
            request.committed, loaded.vocab_size, loaded.context_length, len(draft_tokens) + 1 + request.num_tokens
        )
        sampling = sampling_from_proto(request.sampling, loaded.default_sampling)
        self._check_room(runner, request)
        return _SpeculateCall(runner, tokens, draft_tokens, fanout, sampling, _saguaro(request.saguaro))

    def _check_speculate_size(self, request, vocab_size: int) -> tuple[list[int], list[int]]:
        """A Speculate's draft tokens and fan-out, within this worker's bounds on one call's work."""
        if len(request.draft_tokens) > self._max_depth:
            raise InvalidRequest(f"draft_tokens has {len(request.draft_tokens)} tokens; at most {self._max_depth}")
        draft_tokens = check_token_ids(request.draft_tokens, vocab_size, "draft_tokens")
        fanout = list(request.fanout)
        if len(fanout) != len(draft_tokens) + 1:
            raise InvalidRequest(
                f"fanout needs one entry per outcome k in 0..K: {len(draft_tokens) + 1}, got {len(fanout)}"
            )
        if sum(fanout) > self._max_branches:
            raise InvalidRequest(f"fanout sums to {sum(fanout)} branches; at most {self._max_branches} (--max-speculate-branches)")
        if not 0 <= request.num_tokens <= self._max_depth:
            raise InvalidRequest(f"num_tokens must lie in [0, {self._max_depth}] (--max-speculate-depth), got {request.num_tokens}")
        return draft_tokens, fanout

    def _start_build(
        self, request, call: _SpeculateCall, cancel: threading.Event, guesses: asyncio.Queue
    ) -> asyncio.Future:
        """The tree build on the model thread, inside its spec_speculate span; the branches'
        (k, t*) reach `guesses` right after its step 0."""
        loop = asyncio.get_running_loop()

        def on_guesses(roots: list[tuple[int, int]]) -> None:  # on the model thread, after step 0
            loop.call_soon_threadsafe(guesses.put_nowait, roots)

        job = functools.partial(
            call.runner.speculate_job,
            request.session_id,
            request.committed.start,
            call.tokens,
            call.draft_tokens,
            request.num_tokens,
            call.fanout,
            call.sampling,
            request.max_support,
            *call.saguaro,
            cancel,
            on_guesses,
            request.committed.reserve_tokens,
        )
        run = asyncio.wrap_future(self._step_batcher(call.runner).start(job, request.session_id))
        return asyncio.ensure_future(self._traced(
            "spec_speculate", run, lambda r: {"branches": len(r.branches), "forward_ms": r.forward_ms},
            draft_tokens=len(call.draft_tokens), steps=request.num_tokens + 1, fanout=call.fanout,
        ))


async def _first_guesses(job: asyncio.Future, guesses: asyncio.Queue) -> list[tuple[int, int]] | None:
    """The branches' (k, t*) once step 0 has run; None when the build ended first (it failed)."""
    first = asyncio.ensure_future(guesses.get())
    try:
        await asyncio.wait({job, first}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        if not first.done():
            first.cancel()
    if first.done() and not first.cancelled():
        return first.result()
    return None


def _cache_message(result: SpeculationResult) -> draft_pb2.SpeculationCache:
    entries = [
        draft_pb2.SpeculationEntry(
            accepted=branch.accepted,
            next_token=branch.next_token,
            draft_tokens=branch.draft_tokens,
            draft_probs=[sparse_to_proto(d) for d in branch.draft_dists],
        )
        for branch in result.branches
    ]
    return draft_pb2.SpeculationCache(entries=entries, forward_ms=result.forward_ms)


def _stop_build(cancel: threading.Event, job: asyncio.Future | None) -> None:
    """The caller is gone (cancelled, or the stream closed at a yield): stop the tree between
    steps and drop its outcome, so that a normal cancellation leaves no SpeculationCancelled
    for asyncio to log as a task exception never retrieved."""
    cancel.set()
    if job is not None:
        job.cancel()
        job.add_done_callback(lambda done: done.cancelled() or done.exception())


def _saguaro(params: draft_pb2.SaguaroParams) -> tuple[float, list[int]]:
    """(c, per-position fan-out); an unset message (c = 0, no fan-out) means off."""
    if not params.fanout:
        return 1.0, []
    if not 0.0 <= params.c <= 1.0:
        raise InvalidRequest(f"saguaro.c must lie in [0, 1] (1 = off), got {params.c}")
    return params.c, list(params.fanout)
