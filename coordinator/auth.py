"""Bearer-token auth on the Coordinator service (`--auth-token-file`).

Every RPC of the Coordinator service must carry the metadata `authorization: Bearer TOKEN`, else it
ends UNAUTHENTICATED before its request is even decoded (its HTTP API asks the same header, else
401). Health checks and reflection stay open (a load balancer's probe holds no token). The token is compared in constant time and appears in no log,
error message or span: the denial says only that a token is missing or wrong.
"""

from __future__ import annotations

import hmac

import grpc

from specd.core.config import ConfigError

DENIED = "this coordinator requires metadata `authorization: Bearer TOKEN` with its token (--auth-token-file)"


def read_token(path: str) -> str:
    """The token in the file, without the whitespace or newline an editor leaves at its end."""
    try:
        with open(path, encoding="utf-8") as file:
            token = file.read().rstrip()
    except (OSError, UnicodeDecodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) else "not UTF-8 text"
        raise ConfigError(f"--auth-token-file {path}: cannot read it ({reason})") from None
    if not token:
        raise ConfigError(f"--auth-token-file {path}: the file holds no token")
    return token


def bearer_token_matches(supplied: list, token: bytes) -> bool:
    """Exactly one `authorization` value, of scheme Bearer (any case, as RFC 7235 has it), holding
    the token; the token is compared in constant time. (gRPC metadata and HTTP headers alike.)"""
    if len(supplied) != 1 or not isinstance(supplied[0], str):
        return False
    scheme, _, given = supplied[0].partition(" ")
    return scheme.lower() == "bearer" and hmac.compare_digest(given.encode(), token)


async def _deny_unary(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)


async def _deny_stream(request, context: grpc.aio.ServicerContext):
    await context.abort(grpc.StatusCode.UNAUTHENTICATED, DENIED)
    yield  # never reached: makes this an async generator, the shape a streaming handler has


class BearerTokenInterceptor(grpc.aio.ServerInterceptor):
    """Lets a call to `service` through only with the right bearer token; other services pass."""

    def __init__(self, token: str, service: str):
        self._token = token.encode()
        self._prefix = f"/{service}/"

    def _authorized(self, metadata) -> bool:
        return bearer_token_matches([value for key, value in metadata or () if key == "authorization"], self._token)

    async def intercept_service(self, continuation, details: grpc.HandlerCallDetails):
        if not details.method.startswith(self._prefix) or self._authorized(details.invocation_metadata):
            return await continuation(details)
        handler = await continuation(details)
        if handler is None:
            return None  # an unknown method: gRPC answers UNIMPLEMENTED as it would anyway
        # No request deserializer: the raw bytes of an unauthenticated request are never parsed.
        if handler.response_streaming:
            return grpc.unary_stream_rpc_method_handler(_deny_stream)
        return grpc.unary_unary_rpc_method_handler(_deny_unary)
