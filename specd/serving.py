"""What the three gRPC services share: server set-up, health, reflection, the model thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
from typing import Callable, Iterable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from specd.grpc_port import add_port
from specd.reflection import enable_reflection
from specd.session_cache import SessionNotFound, SessionStale, TooManySessions
from specd.undecodable import UndecodableInterceptor

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


def no_stop_iteration(fn: Callable, *args):
    """`fn(*args)`, with a StopIteration it raises turned into a RuntimeError: asyncio cannot set
    StopIteration on a future, so the call awaiting it would never complete."""
    try:
        return fn(*args)
    except StopIteration as exc:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} raised StopIteration") from exc


class ModelThread:
    """One thread per model: forwards never run on the event loop, and never two at once."""

    def __init__(self, name: str):
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    async def run(self, fn: Callable, *args):
        return await asyncio.get_running_loop().run_in_executor(self._executor, no_stop_iteration, fn, *args)

    def submit(self, fn: Callable, *args) -> concurrent.futures.Future:
        """Queue `fn(*args)` behind the work already queued, from any thread (the model
        thread included: work it queues for itself runs without a turn of the event loop)."""
        return self._executor.submit(no_stop_iteration, fn, *args)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


class StatusError(RuntimeError):
    """An error that carries the gRPC status its caller should get."""

    code = grpc.StatusCode.INTERNAL

    def __init__(self, message: str, code: grpc.StatusCode | None = None):
        super().__init__(message)
        if code is not None:
            self.code = code


class Unavailable(StatusError):
    """A service this call needs cannot serve now; the caller gets UNAVAILABLE."""

    code = grpc.StatusCode.UNAVAILABLE


class ModelLoading(Unavailable):
    """The worker is up but its model is not loaded and warm yet."""

    def __init__(self, message: str = "the model is still loading; retry shortly"):
        super().__init__(message)


class InvalidRequest(ValueError):
    """The request cannot be served as sent; the message names the field to change."""


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str] | None:
    """The gRPC status that tells a caller what went wrong, for the errors specd expects."""
    if isinstance(exc, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, SessionNotFound):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, SessionStale):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, TooManySessions):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, StatusError):
        return exc.code, str(exc)
    return None


async def abort_on_error(context: grpc.aio.ServicerContext, exc: BaseException):
    """Abort the RPC with the mapped status, or INTERNAL with a one-line message (no trace)."""
    mapped = status_for(exc)
    if mapped is None:
        log.exception("unexpected error", exc_info=exc)
        mapped = (grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    await context.abort(*mapped)


class HealthState:
    """The standard health service; NOT_SERVING until the model is loaded and warm."""

    def __init__(self, service_names: Iterable[str]):
        self.servicer = health.aio.HealthServicer()
        self.service_names = ["", *service_names]

    async def set(self, status) -> None:
        for name in self.service_names:
            await self.servicer.set(name, status)


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
    server = grpc.aio.server(interceptors=[UndecodableInterceptor(), *(interceptors or [])], options=SERVER_OPTIONS)
    register(server)
    health_state = HealthState(service_full_names)
    health_pb2_grpc.add_HealthServicer_to_server(health_state.servicer, server)
    enable_reflection([*service_full_names, health.SERVICE_NAME], server)
    return server, add_port(server, f"{host}:{port}", credentials), health_state


async def wait_for_termination(server: grpc.aio.Server, grace_s: float, health: HealthState) -> None:
    """Serve until SIGTERM or SIGINT, then stop gracefully: NOT_SERVING and new calls refused at
    once, calls already running given `grace_s` to finish."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    waiter = asyncio.ensure_future(server.wait_for_termination())
    stopper = asyncio.ensure_future(stop.wait())
    await asyncio.wait([waiter, stopper], return_when=asyncio.FIRST_COMPLETED)
    if stop.is_set():
        log.info("stopping: calls already running have %.0f s to finish", grace_s)
        await health.set(NOT_SERVING)
        # Before the waiter is cancelled: cancelling it cancels the future the stop waits on.
        await server.stop(grace_s)
    waiter.cancel()
    stopper.cancel()


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
        self.closers: list[Callable[[], None]] = []  # run once the server has stopped

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
            close()
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
