"""The HTTP server of the OpenAI-compatible API (aiohttp), on the coordinator's own event loop:
TLS and client certificates as the gRPC port has them, the bearer token of --auth-token-file,
OpenAI's error JSON for every refusal."""

from __future__ import annotations

import logging
from typing import Awaitable, Callable

import grpc
from aiohttp import web

from coordinator.auth import bearer_token_matches
from coordinator.config import CoordinatorConfig
from coordinator.http.app import OpenAiApi
from coordinator.http.errors import ApiError
from coordinator.servicer import CoordinatorServicer
from specd.serving.drain import DrainGate
from specd.serving.tls import server_ssl_context

log = logging.getLogger(__name__)

DENIED = "this coordinator requires the header `Authorization: Bearer TOKEN` with its token (--auth-token-file)"
OPEN_PATHS = ("/health",)  # a load balancer's probe holds no token
# A body holds the prompt JSON-escaped (up to 6 bytes a character) besides the other fields.
_BODY_BYTES_PER_PROMPT_BYTE = 6
_BODY_OVERHEAD_BYTES = 1 << 20

STOP_GRACE_S = 1.0  # as RunningService.stop gives the gRPC server, once the drain is over

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


def _auth_middleware(token: str | None):
    @web.middleware
    async def authorize(request: web.Request, handler: Handler) -> web.StreamResponse:
        if token is None or request.path in OPEN_PATHS:
            return await handler(request)
        if not bearer_token_matches(request.headers.getall("Authorization", []), token.encode()):
            denied = ApiError(grpc.StatusCode.UNAUTHENTICATED, DENIED).response()
            denied.headers["WWW-Authenticate"] = "Bearer"  # RFC 6750: the scheme a 401 asks for
            return denied
        return await handler(request)

    return authorize


@web.middleware
async def _json_not_found(request: web.Request, handler: Handler) -> web.StreamResponse:
    """aiohttp's own 404 and 405 in OpenAI's error shape, as every other answer of the API."""
    try:
        return await handler(request)
    except web.HTTPNotFound:
        return web.json_response(_error_body(f"no route {request.path}; see docs/api.md", "not_found_error"), status=404)
    except web.HTTPMethodNotAllowed as exc:
        message = f"{request.method} {request.path} is not allowed; use {', '.join(sorted(exc.allowed_methods))}"
        return web.json_response(_error_body(message, "invalid_request_error"), status=405)


def _error_body(message: str, kind: str) -> dict:
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class HttpServer:
    """A started HTTP server; stop() closes it, giving requests still running STOP_GRACE_S: the
    coordinator's drain (specd/serving/server.py drain) has already given them --shutdown-grace-s,
    counted with the gRPC calls, so a stop takes that grace once, not twice."""

    def __init__(self, runner: web.AppRunner, port: int):
        self.runner = runner
        self.port = port

    async def stop(self) -> None:
        await self.runner.cleanup()


async def start_http(
    servicer: CoordinatorServicer, config: CoordinatorConfig, token: str | None, gate: DrainGate | None = None
) -> HttpServer:
    """Serve the API on config.host:config.http_port (0: a free port). `gate`: the coordinator's drain,
    which counts the API's requests among its running calls and, once a stop has begun, refuses new ones."""
    api = OpenAiApi(servicer, config.max_prompt_bytes * _BODY_BYTES_PER_PROMPT_BYTE + _BODY_OVERHEAD_BYTES, gate)
    app = web.Application(middlewares=[_json_not_found, _auth_middleware(token)], client_max_size=api.max_body_bytes)
    app.add_routes(api.routes())
    # handler_cancellation: a client that disconnects cancels its request, as a cancelled gRPC call does.
    runner = web.AppRunner(app, handler_cancellation=True, access_log=None, shutdown_timeout=STOP_GRACE_S)
    await runner.setup()
    ssl_context = server_ssl_context(config.tls_cert_file, config.tls_key_file, config.tls_client_ca_file)
    site = web.TCPSite(runner, config.host, config.http_port, ssl_context=ssl_context)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(f"--http-port {config.http_port} on {config.host}: {exc.strerror or exc}") from None
    port = runner.addresses[0][1]
    log.info("http listening on %s:%d%s", config.host, port, " (TLS)" if ssl_context else "")
    return HttpServer(runner, port)
