"""One tensor-parallel job: which rank this process is, launching the other ranks, joining the
process groups, and loading this rank's shard of the target (see target_service/tensor_parallel.py
for the layout)."""

from __future__ import annotations

import dataclasses
import datetime
import json
import logging
import os
import socket
import subprocess
import sys
import threading
from typing import Any

import torch
import torch.distributed as dist

from specd.core.config import ConfigError
from specd.engine.backends import backend_for
from specd.engine.forward import warm_up
from specd.engine.loading import load_causal_lm
from specd.engine.tokenizer_export import export_tokenizer_or_none
from specd.worker.sessions import session_store
from target_service.config import TargetConfig
from target_service.runner import TargetModelRunner

log = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 1800.0  # rendezvous and sharded loading may take long: at least this for the default group
CONFIG_ENV = "SPECD_TP_CONFIG"  # the TargetConfig as JSON, for ranks launched by rank 0
PARENT_ENV = "SPECD_TP_PARENT_PID"  # set on ranks launched by rank 0: they exit when it is gone

# Commands rank 0 broadcasts besides the runner's own methods.
HEARTBEAT = "_heartbeat"
SHUTDOWN = "_shutdown"
END_SESSIONS = "_end_sessions"
RUNNER_METHODS = ("run_batch", "end_session")


class RankFailure(OSError):
    """A rank of the tensor-parallel job failed or vanished: the job cannot serve."""


def out_of_step_error(result: Any) -> Exception | None:
    """The first of a run_batch's per-call results that is an error other than a request error.

    A request error (specd.serving.status.status_for knows it) is raised alike on every rank before any
    collective. Anything else (a forward that failed here: memory, a collective) may have struck
    this rank alone, and the runner reset the call's session here only: the ranks' caches are out
    of step, and the job must go down rather than serve from them.
    """
    from specd.serving.status import status_for

    if not isinstance(result, list):
        return None
    return next((r for r in result if isinstance(r, Exception) and status_for(r) is None), None)


@dataclasses.dataclass
class Job:
    """This process's place in the job, and what rank 0 needs to watch its peers."""

    rank: int
    world_size: int
    local_rank: int
    children: list[subprocess.Popen] = dataclasses.field(default_factory=list)
    failed: threading.Event = dataclasses.field(default_factory=threading.Event)
    failure: str = ""
    command_group: Any = None
    runner: Any = None  # rank 0's TensorParallelTargetRunner once loaded

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


def env_rank() -> tuple[int, int, int] | None:
    if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
        return None
    rank = int(os.environ["RANK"])
    return rank, int(os.environ["WORLD_SIZE"]), int(os.environ.get("LOCAL_RANK", rank))


def free_port(host: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def launch_peers(config: TargetConfig) -> Job:
    """Become rank 0 of a new job on this machine and start ranks 1..N-1 as subprocesses."""
    world = config.tensor_parallel
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(free_port(os.environ["MASTER_ADDR"])))
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE=str(world), LOCAL_WORLD_SIZE=str(world))
    job = Job(rank=0, world_size=world, local_rank=0)
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
        child = subprocess.Popen([sys.executable, "-m", "target_service.tp_follower"], env=env)
        log.info("launched tensor-parallel rank %d as process %d", rank, child.pid)
        job.children.append(child)
    return job


def device_type(config: TargetConfig) -> str:
    """TP runs on the accelerator transformers binds ranks to (one GPU per local rank), else on CPU."""
    accelerator = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else None
    kind = accelerator.type if accelerator is not None else "cpu"
    if config.device not in ("auto", kind) and not config.device.startswith(kind + ":"):
        raise ConfigError(
            f"--device {config.device!r} with --tensor-parallel: each rank uses {kind} device LOCAL_RANK; "
            f"set --device auto (hide GPUs with CUDA_VISIBLE_DEVICES= to run the ranks on CPU)"
        )
    return kind


def init_groups(config: TargetConfig, job: Job) -> str:
    """The default process group (model collectives) and the command group; returns the device."""
    kind = device_type(config)
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


def load_local_runner(config: TargetConfig, job: Job) -> TargetModelRunner:
    """Every rank: join the job, load its shard of the model, warm up (together: warm-up has collectives)."""
    from transformers.distributed import DistributedConfig

    backend = backend_for(device_type(config))
    backend.set_threads(config.threads or 1)
    device = init_groups(config, job)
    log.info("rank %d/%d joined the job on %s; loading %s", job.rank, job.world_size, device, config.model)
    loaded = load_causal_lm(
        config.model,
        dtype=backend.dtype(config.dtype),
        device=device,
        distributed_config=DistributedConfig(tp_size=job.world_size),
    )
    warm_up(loaded.model)
    dist.barrier(group=job.command_group)
    sessions, loaded = session_store(config, loaded, shards=job.world_size, admits=job.rank == 0)
    # Sharded weights are not plain tensors: the backend's fast paths do not apply to them.
    spec = export_tokenizer_or_none(loaded.tokenizer) if job.rank == 0 else None  # rank 0 answers Info
    return TargetModelRunner(loaded, sessions, prefill_chunk=config.prefill_chunk_tokens, backend=backend.name, tokenizer_spec=spec)
