"""Start the target worker: gRPC server first (health NOT_SERVING), then load and warm the model."""

from __future__ import annotations

import asyncio
import logging
import os

from specd.models import load_causal_lm, set_threads
from specd.forward import warm_up
from specd.serving import (
    NOT_SERVING,
    ModelThread,
    RunningService,
    create_server,
    expire_sessions_forever,
    load_then_serve,
)
from specd.metrics import WorkerMetrics
from specd.session_cache import SessionStore
from specd.telemetry import SERVICE_NAMES, get_tracer, server_interceptors, tracer_provider_from_env
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
    """tracer_provider: None builds one from the OTEL_* env vars; interceptors: None traces RPCs."""
    provider = tracer_provider or tracer_provider_from_env(SERVICE_NAMES["target"])
    if interceptors is None:
        interceptors = server_interceptors(provider)
    thread = ModelThread("target-model")
    servicer = TargetServicer(thread, tensor_parallel=config.tensor_parallel)
    servicer.tracer = get_tracer(provider)
    servicer.metrics = WorkerMetrics()
    server, port, health_state = create_server(
        config.host,
        config.port,
        lambda s: target_pb2_grpc.add_TargetWorkerServicer_to_server(servicer, s),
        [SERVICE_NAME],
        interceptors,
    )
    service = RunningService(server, port, health_state, thread)
    service.tracer_provider = provider
    servicer.metrics.serve_for(service, config.host, config.metrics_port)
    await health_state.set(NOT_SERVING)
    await server.start()

    def on_loaded(runner: TargetModelRunner) -> None:
        servicer.runner = runner
        servicer.metrics.track_sessions(lambda: len(runner.sessions))
        service.background.append(
            asyncio.ensure_future(expire_sessions_forever(thread, runner.expire_idle, every_s=10.0))
        )

    service.ready = asyncio.ensure_future(load_then_serve(service, lambda: load_runner(config), on_loaded))
    return service


async def serve(config: TargetConfig) -> None:
    if config.tensor_parallel > 1 or int(os.environ.get("WORLD_SIZE", "1")) > 1:
        from target_service import tensor_parallel

        await tensor_parallel.serve(config)  # N ranks: rank 0 serves, the others follow it
        return
    service = await start_target(config)
    log.info("target worker started on %s:%d, loading %s", config.host, service.port, config.model)
    await service.serve_until_signal()
