"""What the three gRPC services share: server set-up, health, reflection, graceful stop."""

from __future__ import annotations

import asyncio
import inspect
import logging
import signal
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specd.serving.drain import DrainGate
from specd.serving.model_thread import ModelThread
from specd.serving.ports import add_port
from specd.serving.reflection import enable_reflection
from specd.serving.undecodable import UndecodableInterceptor

log = logging.getLogger(__name__)

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING

GRPC_OPTIONS = [
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
]
# Servers accept the coordinator's keepalive pings (every 20 s, also between calls) instead of
# answering them with GOAWAY "too_many_pings". No SO_REUSEPORT (gRPC's default): a second server
# on a port already served must fail to start, not take half of its connections.
SERVER_OPTIONS = GRPC_OPTIONS + [
    ("grpc.so_reuseport", 0),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),
    ("grpc.http2.max_ping_strikes", 0),
]


class HealthState:
    """The standard health service, NOT_SERVING until the model is loaded and warm, and the gate
    that refuses new calls while the server drains."""

    def __init__(self, service_names: Iterable[str]):
        self.servicer = health.aio.HealthServicer()
        self.service_names = ["", *service_names]
        self.gate = DrainGate(service_title(self.service_names[-1]))

    async def set(self, status) -> None:
        for name in self.service_names:
            await self.servicer.set(name, status)


def service_title(full_name: str) -> str:
    """What a refusal calls the service: "specd.v1.TargetWorker" -> "TargetWorker service"."""
    return f"{full_name.rsplit('.', 1)[-1] or 'gRPC'} service"


def create_server(
    host: str,
    port: int,
    register: Callable[[grpc.aio.Server], None],
    service_full_names: list[str],
    interceptors: list | None = None,
    credentials: grpc.ServerCredentials | None = None,
) -> tuple[grpc.aio.Server, int, HealthState]:
    """A grpc.aio server with the given servicers, health and reflection; returns the bound port.

    credentials (specd.tls.server_credentials): serve TLS or mTLS; None serves plaintext."""
    health_state = HealthState(service_full_names)
    server = grpc.aio.server(
        interceptors=[UndecodableInterceptor(), *(interceptors or []), health_state.gate], options=SERVER_OPTIONS
    )
    register(server)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    enable_reflection([*service_full_names, health.SERVICE_NAME], server)
    return server, add_port(server, f"{host}:{port}", credentials), health_state


async def wait_for_termination(server: grpc.aio.Server, grace_s: float, health: HealthState) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully: NOT_SERVING and new calls refused at
    once (UNAVAILABLE, "... is stopping"), calls already running given `grace_s` to finish."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        await drain(server, grace_s, health)
    waiter.cancel()
    stopper.cancel()


async def drain(server: grpc.aio.Server, grace_s: float, health: HealthState) -> None:
    """Refuse new calls while the port stays open, let running ones finish within `grace_s`, then stop."""
    log.info("stopping: %d calls running have %.0f s to finish; new calls are refused", health.gate.running, grace_s)
    deadline = asyncio.get_running_loop().time() + grace_s
    await health.set(NOT_SERVING)
    health.gate.close()
    if not await health.gate.wait_idle(grace_s):
        log.warning("stopping: %d calls still running after %.0f s are cut", health.gate.running, grace_s)
    # Before the caller cancels its waiter: cancelling it cancels the future the stop waits on.
    await server.stop(max(deadline - asyncio.get_running_loop().time(), 0.0))


async def expire_sessions_forever(thread: ModelThread, expire: Callable[[], list[str]], every_s: float) -> None:
    while True:
        await asyncio.sleep(every_s)
        expired = await thread.run(expire)
        if expired:
            log.info("expired %d idle sessions", len(expired))


class RunningService:
    """A started server whose model loads in the background; `ready` completes when it serves."""

    def __init__(self, server: grpc.aio.Server, port: int, health_state: HealthState, thread: ModelThread | None):
        self.server = server
        self.port = port
        self.health = health_state
        self.thread = thread
        self.servicer = None
        self.ready: asyncio.Future | None = None
        self.background: list[asyncio.Task] = []
        self.metrics = None  # the service's specd.metrics.ServiceMetrics
        self.tracer_provider = None
        self.closers: list[Callable[[], object]] = []  # run (and awaited, if they return an awaitable) once the server has stopped
        self.http = None  # the coordinator's HTTP API server, if it serves one

    async def stop(self, grace_s: float = 1.0) -> None:
        for task in self.background:
            task.cancel()
        if self.ready is not None and not self.ready.done():
            self.ready.cancel()
        await self.health.set(NOT_SERVING)
        await self.server.stop(grace_s)
        if self.thread is not None:
            self.thread.shutdown()
        for close in self.closers:
            closed = close()
            if inspect.isawaitable(closed):  # a server of its own, such as the coordinator's HTTP API
                await closed
        self.closers.clear()

    async def serve_until_signal(self, grace_s: float = 5.0) -> None:
        """Serve until a signal, then stop: NOT_SERVING and new calls refused at once, calls
        already running given `grace_s` to finish. A model that fails to load stops the server
        and raises."""
        stopper = asyncio.ensure_future(wait_for_termination(self.server, grace_s, self.health))
        done, _ = await asyncio.wait([stopper, self.ready], return_when=asyncio.FIRST_COMPLETED)
        if self.ready in done and self.ready.exception() is not None:
            stopper.cancel()
            await self.stop()
            raise self.ready.exception()
        await stopper
        await self.stop()


async def load_then_serve(service: RunningService, load: Callable[[], object], on_loaded: Callable[[object], None]) -> None:
    """Load (and warm) the model on its thread, hand it over, then report SERVING."""
    loaded = await service.thread.run(load)
    on_loaded(loaded)
    await service.health.set(SERVING)
    log.info("serving on port %d", service.port)
