"""An undecodable request message is the caller's error: INVALID_ARGUMENT, not UNKNOWN.

gRPC's own handling of a request_deserializer that raises answers UNKNOWN and logs a traceback.
This server interceptor wraps each method's deserializer so that a DecodeError yields a marker
instead, and the method's behaviour so that the marker aborts the call with INVALID_ARGUMENT
before any servicer code sees it.
"""

from __future__ import annotations

import inspect
from typing import Callable

import grpc
from google.protobuf.message import DecodeError


class _Undecodable:
    """Stands in for a request message that did not decode."""

    def __init__(self, error: Exception):
        self.error = error


async def _abort(context: grpc.aio.ServicerContext, marker: _Undecodable) -> None:
    await context.abort(
        grpc.StatusCode.INVALID_ARGUMENT, f"the request message does not decode for this method: {marker.error}"
    )


def _deserializer(deserialize: Callable[[bytes], object]) -> Callable[[bytes], object]:
    def checked(data: bytes):
        try:
            return deserialize(data)
        except DecodeError as exc:
            return _Undecodable(exc)

    return checked


async def _checked_request(request, context):
    """A unary call's request, once known to have decoded."""
    if isinstance(request, _Undecodable):
        await _abort(context, request)
    return request


async def _checked_requests(iterator, context):
    """A streaming call's requests, each checked as it arrives."""

    async def checked():
        async for request in iterator:
            yield await _checked_request(request, context)

    return checked()


def _wrap(behavior: Callable, check: Callable) -> Callable | None:
    """`behavior` (request or iterator, context), of the same kind, with its input `check`ed
    first; None for a synchronous handler (left to gRPC's own handling)."""
    if inspect.iscoroutinefunction(behavior):

        async def checked(arg, context):
            return await behavior(await check(arg, context), context)

        return checked
    if inspect.isasyncgenfunction(behavior):

        async def checked_stream(arg, context):
            responses = behavior(await check(arg, context), context)
            try:
                async for response in responses:
                    yield response
            finally:  # the call ended early: the handler's own cleanup runs now, not at GC
                await responses.aclose()

        return checked_stream
    return None


# (request_streaming, response_streaming) -> the handler's behaviour field, how to check its input
_BEHAVIORS = {
    (False, False): ("unary_unary", _checked_request),
    (False, True): ("unary_stream", _checked_request),
    (True, False): ("stream_unary", _checked_requests),
    (True, True): ("stream_stream", _checked_requests),
}


class UndecodableInterceptor(grpc.aio.ServerInterceptor):
    """Answers INVALID_ARGUMENT to a request whose bytes are not a message of the method's type."""

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler.request_deserializer is None:
            return handler
        name, check = _BEHAVIORS[(handler.request_streaming, handler.response_streaming)]
        behavior = _wrap(getattr(handler, name), check)
        if behavior is None:
            return handler
        return handler._replace(
            request_deserializer=_deserializer(handler.request_deserializer), **{name: behavior}
        )
