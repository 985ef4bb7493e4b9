"""Errors of the OpenAI-compatible HTTP API: specd's statuses as OpenAI's error JSON and HTTP status.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature", "code": "INVALID_ARGUMENT"}}

`code` is the gRPC status code name the same failure gets over gRPC, so both APIs are told alike.
"""

from __future__ import annotations

import json
import logging

import grpc
from aiohttp import web

from specd.serving.status import status_for

log = logging.getLogger(__name__)

# gRPC status -> (HTTP status, OpenAI error type); anything else is a 500.
_HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable_error"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout_error"),
}
_INTERNAL = (500, "internal_error")


class ApiError(Exception):
    """A failure the caller is told in OpenAI's error shape: its gRPC code names the HTTP status."""

    def __init__(self, code: grpc.StatusCode, message: str, param: str | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.param = param

    @property
    def http_status(self) -> int:
        return _HTTP_STATUS.get(self.code, _INTERNAL)[0]

    def body(self) -> dict:
        return {
            "error": {
                "message": self.message,
                "type": _HTTP_STATUS.get(self.code, _INTERNAL)[1],
                "param": self.param,
                "code": self.code.name,
            }
        }

    def response(self) -> web.Response:
        return web.json_response(self.body(), status=self.http_status)

    def sse_event(self) -> bytes:
        """The error as a server-sent event, for a stream whose 200 has already been sent."""
        return f"data: {json.dumps(self.body())}\n\n".encode()


def bad_request(message: str, param: str | None = None) -> ApiError:
    return ApiError(grpc.StatusCode.INVALID_ARGUMENT, message, param)


def api_error(exc: Exception) -> ApiError:
    """The ApiError that tells a caller what went wrong (as status_for maps it for gRPC);
    an unexpected error is logged and told as a one-line INTERNAL error, never a trace."""
    if isinstance(exc, ApiError):
        return exc
    mapped = status_for(exc)
    if mapped is None:
        log.exception("unexpected error", exc_info=exc)
        mapped = (grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}")
    return ApiError(*mapped)
