"""What a caller is told when a call fails: specd's errors as gRPC statuses, at the RPC edge."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import inspect
import logging
from typing import Callable

import grpc

from specd.core.errors import InvalidRequest, SessionNotFound, SessionStale, TooManySessions

log = logging.getLogger(__name__)


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


def call_ended_with(context: grpc.aio.ServicerContext, exc: BaseException) -> grpc.StatusCode:
    """The status a call that raised `exc` ends with: CANCELLED for a caller that went away,
    DEADLINE_EXCEEDED for one whose deadline passed (gRPC cancels the handler then too), else
    what abort_on_error tells the caller."""
    if isinstance(exc, (asyncio.CancelledError, GeneratorExit)):
        remaining = context.time_remaining()
        return grpc.StatusCode.DEADLINE_EXCEEDED if remaining is not None and remaining <= 0 else grpc.StatusCode.CANCELLED
    mapped = status_for(exc)
    return mapped[0] if mapped is not None else grpc.StatusCode.INTERNAL


# on_failure(servicer, code, *args): told how a failed call ends, before the caller is told.
FailureHook = Callable[..., None]


def rpc_edge(method=None, *, on_failure: FailureHook | None = None):
    """An RPC method (unary, or a response stream) whose errors reach the caller as abort_on_error
    maps them. Cancellation (asyncio.CancelledError, GeneratorExit) passes through as it is.

    With `on_failure` (as @rpc_edge(on_failure=...)), every call that fails or is cancelled is
    first reported to on_failure(self, code, *args), args being the method's after `context`."""
    if method is None:
        return functools.partial(rpc_edge, on_failure=on_failure)

    def failed(self, context, exc: BaseException, args) -> None:
        if on_failure is None:
            return
        try:
            on_failure(self, call_ended_with(context, exc), *args)
        except Exception:  # noqa: BLE001 - the caller is still told what went wrong
            log.exception("reporting a failed call failed")

    if inspect.isasyncgenfunction(method):

        @functools.wraps(method)
        async def streaming(self, request, context, *args):
            try:
                # Closed here when the call ends early: its own clean-up runs now, in this task.
                async with contextlib.aclosing(method(self, request, context, *args)) as responses:
                    async for response in responses:
                        yield response
            except (asyncio.CancelledError, GeneratorExit) as exc:
                failed(self, context, exc, args)
                raise
            except Exception as exc:  # noqa: BLE001 - mapped to a status at the RPC edge
                failed(self, context, exc, args)
                await abort_on_error(context, exc)

        return streaming

    @functools.wraps(method)
    async def unary(self, request, context, *args):
        try:
            return await method(self, request, context, *args)
        except asyncio.CancelledError as exc:
            failed(self, context, exc, args)
            raise
        except Exception as exc:  # noqa: BLE001 - mapped to a status at the RPC edge
            failed(self, context, exc, args)
            await abort_on_error(context, exc)

    return unary
