"""Start the draft worker: gRPC server first (health NOT_SERVING), then load and warm the model."""

from __future__ import annotations

import asyncio
import logging

from draft_service.config import DraftConfig
from draft_service.runner import DraftModelRunner
from draft_service.servicer import DraftServicer
from specd.models import load_causal_lm, set_threads
from specd.forward import warm_up
from specd.serving import NOT_SERVING, ModelThread, RunningService, create_server, expire_sessions_forever, load_then_serve
from specd.metrics import WorkerMetrics
from specd.session_cache import SessionStore
from specd.telemetry import SERVICE_NAMES, get_tracer, server_interceptors, tracer_provider_from_env
from specd.v1 import draft_pb2, draft_pb2_grpc

log = logging.getLogger(__name__)

SERVICE_NAME = draft_pb2.DESCRIPTOR.services_by_name["DraftWorker"].full_name


def load_runner(config: DraftConfig) -> DraftModelRunner:
    set_threads(config.threads)
    loaded = load_causal_lm(config.model, dtype=config.dtype, device=config.device)
    warm_up(loaded.model)
    sessions = SessionStore(config.max_sessions, config.session_idle_timeout_s)
    return DraftModelRunner(loaded, sessions, config.max_support)


async def start_draft(config: DraftConfig, interceptors: list | None = None, tracer_provider=None) -> RunningService:
    """tracer_provider: None builds one from the OTEL_* env vars; interceptors: None traces RPCs."""
    provider = tracer_provider or tracer_provider_from_env(SERVICE_NAMES["draft"])
    if interceptors is None:
        interceptors = server_interceptors(provider)
    thread = ModelThread("draft-model")
    servicer = DraftServicer(thread)
    servicer.tracer = get_tracer(provider)
    servicer.metrics = WorkerMetrics()
    server, port, health_state = create_server(
        config.host,
        config.port,
        lambda s: draft_pb2_grpc.add_DraftWorkerServicer_to_server(servicer, s),
        [SERVICE_NAME],
        interceptors,
    )
    service = RunningService(server, port, health_state, thread)
    service.tracer_provider = provider
    servicer.metrics.serve_for(service, config.host, config.metrics_port)
    await health_state.set(NOT_SERVING)
    await server.start()

    def on_loaded(runner: DraftModelRunner) -> None:
        servicer.runner = runner
        servicer.metrics.track_sessions(lambda: len(runner.sessions))
        service.background.append(
            asyncio.ensure_future(expire_sessions_forever(thread, runner.expire_idle, every_s=10.0))
        )

    service.ready = asyncio.ensure_future(load_then_serve(service, lambda: load_runner(config), on_loaded))
    return service


async def serve(config: DraftConfig) -> None:
    service = await start_draft(config)
    log.info("draft worker started on %s:%d, loading %s", config.host, service.port, config.model)
    await service.serve_until_signal()
