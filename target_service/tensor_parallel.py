"""The target worker over N ranks (tensor parallel): one job, rank 0 serves, every rank runs each forward.

Layout of one job of N ranks (`specd serve target --tensor-parallel N`):

- Rank 0 owns the gRPC server, health and sessions. Each runner call (prefill, verify, end
  session, idle expiry) is broadcast as (method name, arguments) to the other ranks before rank 0
  runs it itself, so every rank's SessionStore goes through the same calls in the same order and
  every rank runs the same forward; transformers' tensor parallelism (the model's `tp_plan`)
  shards the weights and does the all-reduces inside that forward.
- Ranks > 0 sit in `follow`: wait for the next call, run it, drop the result.
- Commands travel on a gloo group of their own (CPU objects, even when the model runs on NCCL)
  whose timeout is `--tp-timeout-s`: an idle rank waits there, and rank 0 broadcasts a heartbeat
  every `--tp-heartbeat-s` while it has nothing else to send, so idleness never reaches the
  timeout, while a rank 0 that hangs or dies does.
- Any rank that fails takes the job down: ranks > 0 exit non-zero when a broadcast or a forward
  fails; rank 0 sees a failed broadcast, an unexpected error, or (when it launched them) a rank
  process that exited, reports NOT_SERVING, answers UNAVAILABLE for a short grace, and exits 1.

Started without RANK in the environment, rank 0 launches ranks 1..N-1 itself (this module as a
subprocess, with the environment torchrun would give it), so one command serves on a laptop or in
a container. Under an external `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR set), every rank runs the
same `specd serve target --tensor-parallel N` and takes its role from RANK.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import torch
import torch.distributed as dist

from specd.config import ConfigError
from specd.forward import warm_up
from specd.models import load_causal_lm, set_threads
from specd.serving import NOT_SERVING, Unavailable, status_for
from specd.session_cache import SessionStore
from target_service.config import TargetConfig
from target_service.runner import TargetModelRunner

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0  # rendezvous and sharded loading may take long: at least this for the default group
FAILURE_GRACE_S = 2.0  # after a rank fails: NOT_SERVING and UNAVAILABLE for this long, then exit 1
CONFIG_ENV = "SPECD_TP_CONFIG"  # the TargetConfig as JSON, for ranks launched by rank 0
PARENT_ENV = "SPECD_TP_PARENT_PID"  # set on ranks launched by rank 0: they exit when it is gone

_HEARTBEAT = "_heartbeat"
_SHUTDOWN = "_shutdown"
_END_SESSIONS = "_end_sessions"
_RUNNER_METHODS = ("prefill", "verify", "end_session")


class RankFailure(OSError):
    """A rank of the tensor-parallel job failed or vanished: the job cannot serve."""


@dataclasses.dataclass
class _Job:
    """This process's place in the job, and what rank 0 needs to watch its peers."""

    rank: int
    world_size: int
    local_rank: int
    children: list[subprocess.Popen] = dataclasses.field(default_factory=list)
    failed: threading.Event = dataclasses.field(default_factory=threading.Event)
    failure: str = ""
    command_group: Any = None
    runner: "TensorParallelTargetRunner | None" = None

    def fail(self, reason: str) -> None:
        if not self.failed.is_set():
            self.failure = reason
            self.failed.set()
            log.error("tensor-parallel job failed: %s", reason)

    def dead_child(self) -> str:
        for child in self.children:
            code = child.poll()
            if code is not None:
                return f"rank process {child.pid} exited with code {code}"
        return ""

    def kill_children(self) -> None:
        for child in self.children:
            if child.poll() is None:
                child.kill()


_job: _Job | None = None  # one process is one rank


# ---------------------------------------------------------------- the job: ranks, groups, loading


def _env_rank() -> tuple[int, int, int] | None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def _launch_peers(config: TargetConfig) -> _Job:
    """Become rank 0 of a new job on this machine and start ranks 1..N-1 as subprocesses."""
    world = config.tensor_parallel
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port(os.environ["MASTER_ADDR"])))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    job = _Job(rank=0, world_size=world, local_rank=0)
    for rank in range(1, world):
        env = dict(
            os.environ,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            **{
                CONFIG_ENV: json.dumps(dataclasses.asdict(config)),
                PARENT_ENV: str(os.getpid()),
                "SPECD_LOG_LEVEL": logging.getLevelName(logging.getLogger().getEffectiveLevel()),
            },
        )
        child = subprocess.Popen([sys.executable, "-m", "target_service.tensor_parallel"], env=env)
        log.info("launched tensor-parallel rank %d as process %d", rank, child.pid)
        job.children.append(child)
    return job


def _device_type(config: TargetConfig) -> str:
    """TP runs on the accelerator transformers binds ranks to (one GPU per local rank), else on CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    kind = accelerator.type if accelerator is not None else "cpu"
    if config.device not in ("auto", kind) and not config.device.startswith(kind + ":"):
        raise ConfigError(
            f"--device {config.device!r} with --tensor-parallel: each rank uses {kind} device LOCAL_RANK; "
            f"set --device auto (hide GPUs with CUDA_VISIBLE_DEVICES= to run the ranks on CPU)"
        )
    return kind


def _init_groups(config: TargetConfig, job: _Job) -> str:
    """The default process group (model collectives) and the command group; returns the device."""
    kind = _device_type(config)
    startup = datetime.timedelta(seconds=max(STARTUP_TIMEOUT_S, config.tp_timeout_s))
    if kind == "cuda":
        torch.cuda.set_device(job.local_rank)
        device = f"cuda:{job.local_rank}"
        dist.init_process_group("nccl", rank=job.rank, world_size=job.world_size, timeout=startup,
                                device_id=torch.device(device))
    else:
        device = "cpu"
        dist.init_process_group("gloo", rank=job.rank, world_size=job.world_size, timeout=startup)
    # Commands and heartbeats: CPU objects on gloo, with the serving timeout an idle rank waits under.
    job.command_group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=config.tp_timeout_s))
    return device


def _load_local_runner(config: TargetConfig, job: _Job) -> TargetModelRunner:
    """Every rank: join the job, load its shard of the model, warm up (together: warm-up has collectives)."""
    from transformers.distributed import DistributedConfig

    set_threads(config.threads or 1)
    device = _init_groups(config, job)
    log.info("rank %d/%d joined the job on %s; loading %s", job.rank, job.world_size, device, config.model)
    loaded = load_causal_lm(
        config.model,
        dtype=config.dtype,
        device=device,
        distributed_config=DistributedConfig(tp_size=job.world_size),
    )
    warm_up(loaded.model)
    dist.barrier(group=job.command_group)
    return TargetModelRunner(loaded, SessionStore(config.max_sessions, config.session_idle_timeout_s))


def load_tensor_parallel_runner(config: TargetConfig) -> "TensorParallelTargetRunner":
    """Rank 0's model runner (called from target_service.server.load_runner)."""
    job = _job
    if job is None or job.rank != 0:
        raise RuntimeError("a tensor-parallel target starts through target_service.tensor_parallel.serve")
    local = _load_local_runner(config, job)
    job.runner = TensorParallelTargetRunner(local, job, config.tp_heartbeat_s)
    return job.runner


# ---------------------------------------------------------------- rank 0: broadcast, then run


class TensorParallelTargetRunner:
    """TargetModelRunner's methods on rank 0: broadcast each call, then run it here too."""

    def __init__(self, local: TargetModelRunner, job: _Job, heartbeat_s: float):
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

    def prefill(self, session_id: str, start: int, tokens: list[int]):
        return self._call("prefill", session_id, start, tokens)

    def verify(self, session_id, start, tokens, draft_tokens, draft_dists, sampling, return_logprobs):
        return self._call("verify", session_id, start, tokens, draft_tokens, draft_dists, sampling, return_logprobs)

    def end_session(self, session_id: str) -> bool:
        return self._call("end_session", session_id)

    def expire_idle(self) -> list[str]:
        """Rank 0's clock decides; the other ranks drop the same sessions."""
        with self._lock:
            self._check()
            expired = self.local.sessions.expire_idle()
            if expired:
                self._send(_END_SESSIONS, (expired,))
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
                return getattr(self.local, name)(*args)
            except Exception as exc:
                if status_for(exc) is not None:
                    raise  # a request error: every rank raised it at the same point, before any collective
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
                        self._send(_HEARTBEAT, ())
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
                dist.broadcast_object_list([(_SHUTDOWN, ())], src=0, group=self._job.command_group)
            except Exception as exc:  # noqa: BLE001 - stopping anyway; a signal may have reached them first
                log.info("the other ranks had already stopped (%s)", type(exc).__name__)


# ---------------------------------------------------------------- ranks > 0


def follow(config: TargetConfig, job: _Job) -> None:
    """A rank > 0: load, then run every call rank 0 broadcasts until it says to stop."""
    runner = _load_local_runner(config, job)
    log.info("rank %d ready", job.rank)
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=job.command_group)
        except Exception as exc:  # noqa: BLE001
            raise RankFailure(f"rank {job.rank}: rank 0 is gone or silent: {type(exc).__name__}: {exc}") from None
        name, args = box[0]
        if name == _HEARTBEAT:
            continue
        if name == _SHUTDOWN:
            log.info("rank %d: shutdown from rank 0", job.rank)
            return
        if name == _END_SESSIONS:
            for session_id in args[0]:
                runner.end_session(session_id)
            continue
        if name not in _RUNNER_METHODS:
            raise RankFailure(f"rank {job.rank}: unknown command {name!r}")
        try:
            getattr(runner, name)(*args)
        except Exception as exc:
            if status_for(exc) is None:
                raise  # rank 0 did not see this one: the job is out of step, go down
            # a request error: rank 0 raised the same one and answers the caller


def _exit_with_parent(parent_pid: int) -> None:
    def watch():
        while True:
            if os.getppid() != parent_pid:
                log.error("rank 0 (process %d) is gone; exiting", parent_pid)
                logging.shutdown()
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def _run_follower(config: TargetConfig, job: _Job) -> int:
    try:
        follow(config, job)
    except RankFailure as exc:
        log.error("%s", exc)
        return 1  # no destroy_process_group: its peers are gone, it could only wait for them
    dist.destroy_process_group()
    return 0


# ---------------------------------------------------------------- rank 0: serve and watch


async def _watch(service, job: _Job) -> str:
    """Return the reason once a rank has failed (a runner error, or a launched rank exited)."""
    while True:
        reason = job.failure if job.failed.is_set() else job.dead_child()
        if reason:
            job.fail(reason)
            return reason
        await asyncio.sleep(0.2)


async def serve(config: TargetConfig) -> None:
    """`specd serve target --tensor-parallel N`, on whichever rank this process is."""
    from target_service.server import start_target

    global _job
    env = _env_rank()
    if env is None:
        _job = _launch_peers(config)
    else:
        rank, world, local_rank = env
        if world != config.tensor_parallel:
            raise ConfigError(
                f"WORLD_SIZE={world} but --tensor-parallel {config.tensor_parallel}: launch as many ranks "
                f"as --tensor-parallel (SPECD_TENSOR_PARALLEL)"
            )
        _job = _Job(rank=rank, world_size=world, local_rank=local_rank)
    job = _job
    if job.rank != 0:
        code = await asyncio.to_thread(_run_follower, config, job)
        if code:
            raise RankFailure(f"tensor-parallel rank {job.rank} failed")
        return

    service = await start_target(config)
    log.info("target worker (tensor parallel, %d ranks) started on %s:%d, loading %s",
             job.world_size, config.host, service.port, config.model)
    serving = asyncio.ensure_future(service.serve_until_signal())
    watcher = asyncio.ensure_future(_watch(service, job))
    done, _ = await asyncio.wait([serving, watcher], return_when=asyncio.FIRST_COMPLETED)
    if watcher in done:
        await service.health.set(NOT_SERVING)
        log.error("a tensor-parallel rank failed (%s): NOT_SERVING, exiting in %.1f s", watcher.result(), FAILURE_GRACE_S)
        await asyncio.sleep(FAILURE_GRACE_S)
        job.kill_children()
        logging.shutdown()
        os._exit(1)  # the model thread may sit in a collective that will never finish
    watcher.cancel()
    try:
        serving.result()
    finally:
        if job.runner is None:
            job.kill_children()  # never loaded: they wait for rank 0 in rendezvous or loading
        else:
            await asyncio.to_thread(job.runner.shutdown)
        for child in job.children:
            try:
                await asyncio.to_thread(child.wait, 10)
            except subprocess.TimeoutExpired:
                child.kill()


def main() -> int:
    """A rank launched by rank 0: `python -m target_service.tensor_parallel` with SPECD_TP_CONFIG."""
    env = _env_rank()
    if env is None or CONFIG_ENV not in os.environ:
        print("target_service.tensor_parallel: started by `specd serve target --tensor-parallel N`", file=sys.stderr)
        return 2
    rank, world, local_rank = env
    logging.basicConfig(
        level=os.environ.get("SPECD_LOG_LEVEL", "INFO").upper(),
        format=f"%(asctime)s rank{rank} %(name)s %(levelname)s %(message)s",
    )
    config = TargetConfig(**json.loads(os.environ[CONFIG_ENV]))
    if PARENT_ENV in os.environ:
        # Rank 0 owns this rank's life: it broadcasts the stop, and its exit ends this rank (see
        # _exit_with_parent). A Ctrl-C or a SIGTERM sent to the whole process group must not end
        # this rank first, or rank 0 would take its graceful stop for a failed rank.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _exit_with_parent(int(os.environ[PARENT_ENV]))
    return _run_follower(config, _Job(rank=rank, world_size=world, local_rank=local_rank))


if __name__ == "__main__":
    sys.exit(main())
