"""Start the target worker: gRPC server first (health NOT_SERVING), then load and warm the model."""

from __future__ import annotations

import logging
import os

from specd.models import load_causal_lm, set_threads
from specd.forward import warm_up
from specd.serving import RunningService
from specd.session_cache import SessionStore
from specd.worker_server import start_worker
from specd.v1 import target_pb2, target_pb2_grpc
from target_service.config import TargetConfig
from target_service.runner import TargetModelRunner
from target_service.servicer import TargetServicer

log = logging.getLogger(__name__)

SERVICE_NAME = target_pb2.DESCRIPTOR.services_by_name["TargetWorker"].full_name


def load_runner(config: TargetConfig) -> TargetModelRunner:
    if config.tensor_parallel > 1:
        from target_service.tensor_parallel import load_tensor_parallel_runner

        return load_tensor_parallel_runner(config)
    set_threads(config.threads)
    loaded = load_causal_lm(config.model, dtype=config.dtype, device=config.device)
    warm_up(loaded.model)
    return TargetModelRunner(loaded, SessionStore(config.max_sessions, config.session_idle_timeout_s))


async def start_target(config: TargetConfig, interceptors: list | None = None, tracer_provider=None) -> RunningService:
    return await start_worker(
        "target",
        config,
        lambda thread: TargetServicer(thread, config.verify_after_wait_s, tensor_parallel=config.tensor_parallel),
        target_pb2_grpc.add_TargetWorkerServicer_to_server,
        SERVICE_NAME,
        lambda: load_runner(config),
        interceptors,
        tracer_provider,
    )


async def serve(config: TargetConfig) -> None:
    if config.tensor_parallel > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from target_service import tensor_parallel

        await tensor_parallel.serve(config)  # N ranks: rank 0 serves, the others follow it
        return
    service = await start_target(config)
    log.info("target worker started on %s:%d, loading %s", config.host, service.port, config.model)
    await service.serve_until_signal()
