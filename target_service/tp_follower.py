"""Ranks > 0 of a tensor-parallel target: load this rank's shard, then run every call rank 0
broadcasts until it says stop (or goes silent). Rank 0 launches these as
`python -m target_service.tp_follower`; under torchrun they come through `specd serve target`."""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import threading
import time
from typing import Any

import torch.distributed as dist

from specd.serving.status import status_for
from target_service.config import TargetConfig
from target_service.tp_job import (
    CONFIG_ENV,
    END_SESSIONS,
    HEARTBEAT,
    PARENT_ENV,
    RUNNER_METHODS,
    SHUTDOWN,
    Job,
    RankFailure,
    env_rank,
    load_local_runner,
    out_of_step_error,
)

log = logging.getLogger(__name__)


def follow(config: TargetConfig, job: Job) -> None:
    """A rank > 0: load, then run every call rank 0 broadcasts until it says to stop."""
    runner = load_local_runner(config, job)
    log.info("rank %d ready", job.rank)
    while True:
        box: list[Any] = [None]
        try:
            dist.broadcast_object_list(box, src=0, group=job.command_group)
        except Exception as exc:  # noqa: BLE001
            raise RankFailure(f"rank {job.rank}: rank 0 is gone or silent: {type(exc).__name__}: {exc}") from None
        name, args = box[0]
        if name == HEARTBEAT:
            continue
        if name == SHUTDOWN:
            log.info("rank %d: shutdown from rank 0", job.rank)
            return
        if name == END_SESSIONS:
            for session_id in args[0]:
                runner.end_session(session_id)
            continue
        if name not in RUNNER_METHODS:
            raise RankFailure(f"rank {job.rank}: unknown command {name!r}")
        try:
            result = getattr(runner, name)(*args)
        except Exception as exc:
            if status_for(exc) is None:
                raise  # rank 0 did not see this one: the job is out of step, go down
            continue  # a request error: rank 0 raised the same one and answers the caller
        failed = out_of_step_error(result)  # run_batch hands each call's error back instead of raising it
        if failed is not None:
            raise RankFailure(f"rank {job.rank}: {name} failed here: {type(failed).__name__}: {failed}")


def exit_with_parent(parent_pid: int) -> None:
    def watch():
        while True:
            if os.getppid() != parent_pid:
                log.error("rank 0 (process %d) is gone; exiting", parent_pid)
                logging.shutdown()
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="tp-parent-watch", daemon=True).start()


def run_follower(config: TargetConfig, job: Job) -> int:
    try:
        follow(config, job)
    except RankFailure as exc:
        log.error("%s", exc)
        return 1  # no destroy_process_group: its peers are gone, it could only wait for them
    dist.destroy_process_group()
    return 0


def main() -> int:
    """A rank launched by rank 0: `python -m target_service.tp_follower` with SPECD_TP_CONFIG."""
    env = env_rank()
    if env is None or CONFIG_ENV not in os.environ:
        print("target_service.tp_follower: started by `specd serve target --tensor-parallel N`", file=sys.stderr)
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
        exit_with_parent(int(os.environ[PARENT_ENV]))
    return run_follower(config, Job(rank=rank, world_size=world, local_rank=local_rank))


if __name__ == "__main__":
    sys.exit(main())
