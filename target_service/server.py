"""`specd serve target`: one process, or a tensor-parallel job of N ranks."""

from __future__ import annotations

import logging
import os

from target_service import tensor_parallel
from target_service.config import TargetConfig
from target_service.worker import SERVICE_NAME, load_runner, start_target

__all__ = ["SERVICE_NAME", "load_runner", "serve", "start_target"]

log = logging.getLogger(__name__)


async def serve(config: TargetConfig) -> None:
    if config.tensor_parallel > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        await tensor_parallel.serve(config)  # N ranks: rank 0 serves, the others follow it
        return
    service = await start_target(config)
    log.info("target worker started on %s:%d, loading %s", config.host, service.port, config.model)
    await service.serve_until_signal()
