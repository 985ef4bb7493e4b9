"""A graceful stop's drain: new calls refused with a message that says why, running calls counted
until they finish.

gRPC's own graceful stop (server.stop(grace)) closes the listening port at once, so a new call
fails to connect and its caller cannot tell a stopping server from one that is not there. While
the gate is closed the port stays open: a new call is answered UNAVAILABLE "... is stopping",
and the server is stopped once the calls already running have finished (or the grace is over).
Health and reflection calls pass the gate: health answers NOT_SERVING while the server drains.
"""

from __future__ import annotations

import asyncio
import inspect
from typing import Callable

import grpc

_UNGATED_PREFIXES = ("/grpc.health.", "/grpc.reflection.")
_BEHAVIOR_NAMES = {
    (False, False): "unary_unary",
    (False, True): "unary_stream",
    (True, False): "stream_unary",
    (True, True): "stream_stream",
}


class DrainGate(grpc.aio.ServerInterceptor):
    """Counts the calls running; once closed, refuses new ones with UNAVAILABLE."""

    def __init__(self, service: str):
        self.refusal = (f"the {service} is stopping: it finishes the calls it runs and takes no new ones; "
                        "retry once it is back, or on another replica")
        self.closed = False
        self.running = 0
        self._idle = asyncio.Event()
        self._idle.set()

    def close(self) -> None:
        self.closed = True

    async def wait_idle(self, timeout_s: float) -> bool:
        """Whether every running call finished within `timeout_s`."""
        try:
            await asyncio.wait_for(self._idle.wait(), max(timeout_s, 0.0))
        except asyncio.TimeoutError:
            return False
        return True

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(_UNGATED_PREFIXES):
            return handler
        name = _BEHAVIOR_NAMES[(handler.request_streaming, handler.response_streaming)]
        wrap = self._refusing if self.closed else self._counting
        behavior = wrap(getattr(handler, name))
        return handler if behavior is None else handler._replace(**{name: behavior})

    def started(self) -> None:
        """A call began (a front other than gRPC on the same service counts its requests too)."""
        self.running += 1
        self._idle.clear()

    def ended(self) -> None:
        self.running -= 1
        if self.running == 0:
            self._idle.set()

    def _counting(self, behavior: Callable) -> Callable | None:
        """`behavior`, of the same kind, counted while it runs; None for a synchronous one."""
        if inspect.iscoroutinefunction(behavior):

            async def counted(arg, context):
                self.started()
                try:
                    return await behavior(arg, context)
                finally:
                    self.ended()

            return counted
        if inspect.isasyncgenfunction(behavior):

            async def counted_stream(arg, context):
                self.started()
                responses = behavior(arg, context)
                try:
                    async for response in responses:
                        yield response
                finally:  # the call ended early: the handler's own cleanup runs now, not at GC
                    await responses.aclose()
                    self.ended()

            return counted_stream
        return None

    def _refusing(self, behavior: Callable) -> Callable | None:
        """A behaviour of `behavior`'s kind that answers UNAVAILABLE with the refusal."""
        if inspect.iscoroutinefunction(behavior):

            async def refused(arg, context):
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal)

            return refused
        if inspect.isasyncgenfunction(behavior):

            async def refused_stream(arg, context):
                await context.abort(grpc.StatusCode.UNAVAILABLE, self.refusal)
                yield  # never reached: makes this a stream handler, as the method's is

            return refused_stream
        return None
