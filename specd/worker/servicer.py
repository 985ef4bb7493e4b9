"""What the two model workers' servicers share: readiness, Prefill, EndSession, Info's common part.

DraftServicer and TargetServicer subclass WorkerServicer; each adds its own RPCs (Propose and
Speculate; Verify and VerifyAfter) and names its response messages.
"""

from __future__ import annotations

from specd.observability.telemetry import get_tracer
from specd.serving.model_thread import ModelThread
from specd.serving.retired_sessions import RetiredSessions
from specd.serving.status import ModelLoading, rpc_edge
from specd.wire.checks import check_committed, check_id_length, check_session_id


class WorkerServicer:
    """A model worker's servicer: its requests run on `thread`, once `runner` is loaded."""

    def __init__(self, thread: ModelThread, retired_session_memory_s: float = 30.0):
        self._thread = thread
        self.retired = RetiredSessions(retired_session_memory_s)  # their late calls are refused
        self.runner = None  # set once the model is loaded (start_worker)
        self.tracer = get_tracer(None)  # the service's tracer and metrics, set by start_worker
        self.metrics = None

    # The subclass's response messages and info message (its proto module's types).
    prefill_response: type
    end_session_response: type

    def _info(self, runner):
        """The worker's Info message for the loaded runner; common_info(runner.loaded) holds the shared fields."""
        raise NotImplementedError

    def _forget(self, session_id: str) -> None:
        """Drop what this worker holds for a session besides its KV cache (EndSession)."""

    def _check_open_session_id(self, session_id: str) -> None:
        """A well-formed id that no EndSession retired lately (specd/serving/retired_sessions.py): a call
        that may open its session checks this before it is queued."""
        check_session_id(session_id)
        self.retired.check(session_id)

    def _check_room(self, runner, request) -> None:
        """TooManySessions now for a call whose new session the worker has no room for (its count
        or KV budget): told at once, not after waiting for its place on the model thread."""
        runner.sessions.check_admits(request.session_id, request.committed.start, request.committed.reserve_tokens)

    def _ready_runner(self):
        """The loaded runner; ModelLoading (UNAVAILABLE) until the model is loaded and warm."""
        if self.runner is None:
            raise ModelLoading()
        return self.runner

    def _observe(self, op: str, forward_ms: float, batch_size: int | None = None) -> None:
        """A call's model time, in specd_forward_seconds{op}; with `batch_size`, one forward's,
        and how many sessions it served, in specd_forward_batch_size{op}."""
        if self.metrics is not None:
            self.metrics.observe_forward(op, forward_ms)
            if batch_size is not None:
                self.metrics.observe_batch(op, batch_size)

    @rpc_edge
    async def Prefill(self, request, context):
        runner = self._ready_runner()
        self._check_open_session_id(request.session_id)
        tokens = check_committed(request.committed, runner.loaded.vocab_size, runner.loaded.context_length, 0)
        self._check_room(runner, request)
        cached, forward_ms = await self._thread.run(
            runner.prefill, request.session_id, request.committed.start, tokens, request.committed.reserve_tokens
        )
        self._observe("prefill", forward_ms)
        return self.prefill_response(cached_tokens=cached, forward_ms=forward_ms)

    @rpc_edge
    async def EndSession(self, request, context):
        runner = self._ready_runner()
        # Only its length: ending a session id that never existed answers existed=False.
        check_id_length(request.session_id, "session_id")
        if request.retire_id:
            self.retired.add(request.session_id)
        self._forget(request.session_id)
        existed = await self._thread.run(runner.end_session, request.session_id)
        return self.end_session_response(existed=existed)

    @rpc_edge
    async def Info(self, request, context):
        runner = self._ready_runner()
        info = self._info(runner)
        # The coordinator sizes its admission to this (coordinator/admission.py), and takes the
        # tuned defaults of the target's backend (coordinator/profiles.py).
        info.max_sessions = runner.sessions.max_sessions
        info.backend = runner.backend
        info.fast_paths.extend(runner.fast_paths)
        return info


def common_info(loaded) -> dict:
    """The fields DraftInfo and TargetInfo share, from a LoadedModel."""
    return {
        "model": loaded.name,
        "vocab_size": loaded.vocab_size,
        "context_length": loaded.context_length,
        "dtype": loaded.dtype,
        "device": loaded.device,
        "tokenizer_fingerprint": loaded.tokenizer_fingerprint,
    }
