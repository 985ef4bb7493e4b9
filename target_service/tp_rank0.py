"""Rank 0's model runner for a tensor-parallel target: every runner call is broadcast to the other
ranks, then run here too, so all ranks run the same forwards over the same sessions."""

from __future__ import annotations

import logging
import threading
import time

import torch.distributed as dist

from specd.engine.session_cache import SessionStore
from specd.serving.status import Unavailable, status_for
from target_service.config import TargetConfig
from target_service.runner import TargetModelRunner
from target_service.tp_job import END_SESSIONS, HEARTBEAT, SHUTDOWN, Job, load_local_runner, out_of_step_error

log = logging.getLogger(__name__)


def load_tensor_parallel_runner(config: TargetConfig, job: Job) -> "TensorParallelTargetRunner":
    """Rank 0: load this rank's shard together with the others, then wrap it in the broadcasting runner."""
    if job.rank != 0:
        raise RuntimeError(f"rank {job.rank} follows rank 0 (target_service.tp_follower); only rank 0 serves")
    local = load_local_runner(config, job)
    job.runner = TensorParallelTargetRunner(local, job, config.tp_heartbeat_s)
    return job.runner


class TensorParallelTargetRunner:
    """TargetModelRunner's methods on rank 0: broadcast each call, then run it here too."""

    def __init__(self, local: TargetModelRunner, job: Job, heartbeat_s: float):
        self.local = local
        self._job = job
        self._lock = threading.Lock()  # one broadcast + run at a time; heartbeats slot in between
        self._last_sent = time.monotonic()
        self._closed = False
        self._heartbeat_s = heartbeat_s
        self._heartbeat = threading.Thread(target=self._beat, name="tp-heartbeat", daemon=True)
        self._heartbeat.start()

    @property
    def loaded(self):
        return self.local.loaded

    @property
    def sessions(self) -> SessionStore:
        return self.local.sessions

    @property
    def backend(self) -> str:
        return self.local.backend

    @property
    def tokenizer_spec(self):
        return self.local.tokenizer_spec

    @property
    def fast_paths(self) -> tuple[str, ...]:
        return self.local.fast_paths

    def run_batch(self, calls, most_tokens=None):
        """Every rank runs the packed forward: a call that fails fails alike on each, before any
        collective; rank 0's `most_tokens` goes with the calls, so every rank cuts them alike."""
        return self._call("run_batch", calls, most_tokens)

    @property
    def last_forward(self):
        return self.local.last_forward

    def end_session(self, session_id: str) -> bool:
        return self._call("end_session", session_id)

    def expire_idle(self) -> list[str]:
        """Rank 0's clock decides; the other ranks drop the same sessions."""
        with self._lock:
            self._check()
            expired = self.local.sessions.expire_idle()
            if expired:
                self._send(END_SESSIONS, (expired,))
            return expired

    def _check(self) -> None:
        if self._job.failed.is_set():
            raise Unavailable(f"the tensor-parallel target lost a rank ({self._job.failure}); it is restarting")
        if self._closed:
            raise Unavailable("the tensor-parallel target is shutting down")

    def _send(self, name: str, args: tuple) -> None:
        try:
            dist.broadcast_object_list([(name, args)], src=0, group=self._job.command_group)
        except Exception as exc:  # noqa: BLE001 - a peer is gone or timed out
            self._job.fail(f"broadcast of {name} failed: {type(exc).__name__}: {exc}")
            raise Unavailable(f"the tensor-parallel target lost a rank ({self._job.failure})") from None
        self._last_sent = time.monotonic()

    def _call(self, name: str, *args):
        with self._lock:
            self._check()
            self._send(name, args)
            try:
                result = getattr(self.local, name)(*args)
            except Exception as exc:
                if status_for(exc) is not None:
                    raise  # a request error: every rank raised it at the same point, before any collective
                self._fail(name, exc)
            failed = out_of_step_error(result)  # run_batch hands each call's error back instead of raising it
            if failed is not None:
                self._fail(name, failed)
            return result

    def _fail(self, name: str, exc: Exception) -> None:
        self._job.fail(f"{name} failed on rank 0: {type(exc).__name__}: {exc}")
        raise Unavailable(f"the tensor-parallel target failed ({self._job.failure})") from None

    def _beat(self) -> None:
        while not self._closed and not self._job.failed.is_set():
            wait = self._last_sent + self._heartbeat_s - time.monotonic()
            if wait > 0:
                time.sleep(min(wait, 1.0))
                continue
            with self._lock:
                if self._closed or self._job.failed.is_set():
                    return
                if time.monotonic() - self._last_sent >= self._heartbeat_s:
                    try:
                        self._send(HEARTBEAT, ())
                    except Unavailable:
                        return

    def shutdown(self) -> None:
        """Tell the other ranks to exit (best effort: they also exit when rank 0 is gone)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            if self._job.failed.is_set():
                return
            try:
                dist.broadcast_object_list([(SHUTDOWN, ())], src=0, group=self._job.command_group)
            except Exception as exc:  # noqa: BLE001 - stopping anyway; a signal may have reached them first
                log.info("the other ranks had already stopped (%s)", type(exc).__name__)
