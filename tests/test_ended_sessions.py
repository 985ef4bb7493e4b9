"""A request's worker calls never open its session again once the request has ended.

A call still running when a request is cancelled may reach the worker after the request's
EndSession: it is answered NOT_FOUND, and a resend of the whole history from position 0 would
open the session again, held on the worker until its idle timeout.
"""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from coordinator.workers import WorkerSession, _synced_call
from specd.v1 import common_pb2


class _Worker:
    """Answers like a worker that lost (or ended) the session: NOT_FOUND unless sent from 0."""

    def __init__(self, on_first_call=None):
        self.sent: list[int] = []
        self.on_first_call = on_first_call

    async def __call__(self, tail: common_pb2.CommittedTokens, timeout_s: float):
        self.sent.append(tail.start)
        if len(self.sent) == 1 and self.on_first_call is not None:
            self.on_first_call()
        if tail.start != 0:
            raise grpc.aio.AioRpcError(grpc.StatusCode.NOT_FOUND, None, None, details="no such session")
        return common_pb2.CommittedTokens(start=0)


def _run(coro):
    return asyncio.run(coro)


def test_a_live_session_is_resent_from_the_start():
    session, worker = WorkerSession("s", sent=3), _Worker()
    _run(_synced_call(session, [1, 2, 3, 4], worker, deadline=_far()))
    assert worker.sent == [3, 0]


def test_a_session_whose_request_ended_is_not_resent():
    session = WorkerSession("s", sent=3)
    worker = _Worker(on_first_call=lambda: setattr(session, "ended", True))  # the request ends meanwhile
    with pytest.raises(asyncio.CancelledError):
        _run(_synced_call(session, [1, 2, 3, 4], worker, deadline=_far()))
    assert worker.sent == [3]


def test_nothing_is_sent_for_an_ended_session():
    session, worker = WorkerSession("s", ended=True), _Worker()
    with pytest.raises(asyncio.CancelledError):
        _run(_synced_call(session, [1, 2], worker, deadline=_far()))
    assert worker.sent == []


def _far() -> float:
    return time.monotonic() + 60.0
