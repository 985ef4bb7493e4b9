"""Starting a model worker: gRPC server first (health NOT_SERVING), then load and warm the model."""

from __future__ import annotations

import asyncio
from typing import Callable

from specd.observability.metrics import WorkerMetrics
from specd.observability.telemetry import SERVICE_NAMES, get_tracer, server_interceptors, tracer_provider_from_env
from specd.serving.model_thread import ModelThread
from specd.serving.server import NOT_SERVING, RunningService, create_server, expire_sessions_forever, load_then_serve
from specd.serving.tls import server_credentials
from specd.worker.config import WorkerConfig


async def start_worker(
    role: str,
    config: WorkerConfig,
    make_servicer: Callable[[ModelThread], object],
    add_servicer: Callable,
    service_name: str,
    load_runner: Callable[[], object],
    interceptors: list | None = None,
    tracer_provider=None,
) -> RunningService:
    """Serve `role` at once and load its runner on the model thread; `ready` completes when it serves.

    tracer_provider: None builds one from the OTEL_* env vars; interceptors: None traces RPCs.
    The servicer gets `.runner` once loaded (None until then), `.tracer` and `.metrics`.
    """
    credentials = server_credentials(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    provider = tracer_provider or tracer_provider_from_env(SERVICE_NAMES[role])
    if interceptors is None:
        interceptors = server_interceptors(provider)
    thread = ModelThread(f"{role}-model")
    servicer = make_servicer(thread)
    servicer.tracer = get_tracer(provider)
    servicer.metrics = WorkerMetrics(role)
    server, port, health_state = create_server(
        config.host, config.port, lambda s: add_servicer(servicer, s), [service_name], interceptors, credentials
    )
    service = RunningService(server, port, health_state, thread)
    service.servicer = servicer
    service.tracer_provider = provider
    servicer.metrics.serve_for(service, config.host, config.metrics_port)
    await health_state.set(NOT_SERVING)
    await server.start()

    def on_loaded(runner) -> None:
        servicer.runner = runner
        servicer.metrics.track_sessions(runner.sessions)
        servicer.metrics.report_backend(runner)
        service.background.append(
            asyncio.ensure_future(expire_sessions_forever(thread, runner.expire_idle, every_s=10.0))
        )

    service.ready = asyncio.ensure_future(load_then_serve(service, load_runner, on_loaded))
    return service
