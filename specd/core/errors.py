"""The errors every layer raises and the serving layer maps to gRPC statuses (specd/serving/status.py)."""

from __future__ import annotations

from typing import Callable


class InvalidRequest(ValueError):
    """The request cannot be served as sent; the message names the field to change."""


class SessionNotFound(LookupError):
    """The worker holds no such session (expired, ended, or the worker restarted)."""


class SessionStale(RuntimeError):
    """The request assumes cached tokens this session does not have."""


class TooManySessions(RuntimeError):
    """The worker has no room for another session (its count cap, or its KV budget). Its message
    starts with NO_SESSION_ROOM, which a coordinator tells apart from other RESOURCE_EXHAUSTED
    statuses by: it waits for room instead of failing the request."""

    def __init__(self, message: str):
        super().__init__(NO_SESSION_ROOM + message)


NO_SESSION_ROOM = "no room for a session: "


def no_stop_iteration(fn: Callable, *args):
    """`fn(*args)`, with a StopIteration it raises turned into a RuntimeError: asyncio cannot set
    StopIteration on a future, so the call awaiting it would never complete."""
    try:
        return fn(*args)
    except StopIteration as exc:
        raise RuntimeError(f"{getattr(fn, '__name__', fn)} raised StopIteration") from exc
