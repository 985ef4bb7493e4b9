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

Started without RANK in the environment, rank 0 launches ranks 1..N-1 itself (as subprocesses,
with the environment torchrun would give them), so one command serves on a laptop or in
a container. Under an external `torchrun` (RANK, WORLD_SIZE, MASTER_ADDR set), every rank runs the
same `specd serve target --tensor-parallel N` and takes its role from RANK.

Files: this one serves rank 0 and watches the job; `tp_job.py` launches ranks, joins the groups and
loads a rank's shard; `tp_rank0.py` is rank 0's broadcasting runner; `tp_follower.py` is the loop of
ranks > 0.
"""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess

from specd.core.config import ConfigError
from specd.serving.server import NOT_SERVING
from target_service.config import TargetConfig
from target_service.tp_follower import run_follower
from target_service.tp_job import Job, RankFailure, env_rank, launch_peers
from target_service.tp_rank0 import load_tensor_parallel_runner
from target_service.worker import start_target

log = logging.getLogger(__name__)

FAILURE_GRACE_S = 2.0  # after a rank fails: NOT_SERVING and UNAVAILABLE for this long, then exit 1


def join_job(config: TargetConfig) -> Job:
    """This process's rank: from torchrun's environment, or rank 0 of a job it launches now."""
    env = env_rank()
    if env is None:
        return launch_peers(config)
    rank, world, local_rank = env
    if world != config.tensor_parallel:
        raise ConfigError(
            f"WORLD_SIZE={world} but --tensor-parallel {config.tensor_parallel}: launch as many ranks "
            f"as --tensor-parallel (SPECD_TENSOR_PARALLEL)"
        )
    return Job(rank=rank, world_size=world, local_rank=local_rank)


async def serve(config: TargetConfig) -> None:
    """`specd serve target --tensor-parallel N`, on whichever rank this process is."""
    job = join_job(config)
    if job.rank != 0:
        code = await asyncio.to_thread(run_follower, config, job)
        if code:
            raise RankFailure(f"tensor-parallel rank {job.rank} failed")
        return
    await serve_rank0(config, job)


async def _watch(job: Job) -> str:
    """Return the reason once a rank has failed (a runner error, or a launched rank exited)."""
    while True:
        reason = job.failure if job.failed.is_set() else job.dead_child()
        if reason:
            job.fail(reason)
            return reason
        await asyncio.sleep(0.2)


async def serve_rank0(config: TargetConfig, job: Job) -> None:
    """Serve gRPC until a signal; a failed rank takes the whole job down (exit 1)."""
    service = await start_target(config, load=lambda: load_tensor_parallel_runner(config, job))
    log.info("target worker (tensor parallel, %d ranks) started on %s:%d, loading %s",
             job.world_size, config.host, service.port, config.model)
    serving = asyncio.ensure_future(service.serve_until_signal())
    watcher = asyncio.ensure_future(_watch(job))
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
        await _stop_peers(job)


async def _stop_peers(job: Job) -> None:
    if job.runner is None:
        job.kill_children()  # never loaded: they wait for rank 0 in rendezvous or loading
    else:
        await asyncio.to_thread(job.runner.shutdown)
    for child in job.children:
        try:
            await asyncio.to_thread(child.wait, 10)
        except subprocess.TimeoutExpired:
            child.kill()
