"""A target at its --max-sessions: a new session's first call waits for one to free instead of
failing, asks again when a session of its coordinator ends, in the order the requests were
refused, and, while the target refuses sessions, open_session waits for the request's session
before any round (coordinator/session_wait.py); the wait is an event on the request's span.

Against a real target worker holding ONE session, through the coordinator's own TargetLink.
"""

from __future__ import annotations

import asyncio

import grpc
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordinator.target_link import SESSION_WAIT_EVENT, TargetLink
from coordinator.workers import WorkerSession
from specd.core.errors import NO_SESSION_ROOM
from specd.serving.status import StatusError
from tests.conftest import running_stack
from tests.stack import wait_for

PROMPT = [5, 17, 33, 8]
SETTLE_S = 20.0


@pytest.fixture(scope="module")
def one_session_target(tiny_pair):
    with running_stack(tiny_pair[0], None, target_overrides={"max_sessions": 1}) as stack:
        yield stack


def test_new_sessions_wait_their_turn_for_a_session_to_free(one_session_target):
    stack = one_session_target

    async def scenario() -> None:
        link = TargetLink(f"127.0.0.1:{stack.target.port}", timeout_s=10.0)
        first, second, third = (WorkerSession(f"session-wait-{n}") for n in range(3))
        try:
            await link.prefill(first, PROMPT)  # the target's one session
            assert first.opened and not link.session_wait.full
            waiting = asyncio.ensure_future(link.prefill(second, PROMPT))
            await until(lambda: link.session_wait.waiting == 1, "the second session waits")
            assert link.session_wait.full and not second.opened
            # While the target refuses sessions, a request opens its own before any round: it waits too.
            opening = asyncio.ensure_future(link.open_session(third, PROMPT))
            await until(lambda: link.session_wait.waiting == 2, "the third session waits")
            # The freed session goes to the request refused first: refused requests ask again in turn.
            await link.end_session(first.session_id)
            await asyncio.wait_for(waiting, SETTLE_S)
            assert second.opened and not opening.done() and link.session_wait.waiting == 1
            await link.end_session(second.session_id)
            await asyncio.wait_for(opening, SETTLE_S)
            assert second.opened and third.opened
            # open_session sent one token, which a prefill keeps back: nothing cached, the round sends all.
            assert third.sent == 0
        finally:
            for session in (second, third):
                await link.end_session(session.session_id)
            await link.close()

    stack.run(scenario(), timeout=60.0)
    assert wait_for(lambda: len(stack.target.servicer.runner.sessions) == 0, SETTLE_S)


def test_open_session_sends_nothing_while_the_target_has_room(one_session_target):
    stack = one_session_target

    async def scenario() -> None:
        link = TargetLink(f"127.0.0.1:{stack.target.port}", timeout_s=10.0)
        session = WorkerSession("session-wait-room")
        try:
            await link.open_session(session, PROMPT)
            assert not session.opened  # no call: the first round's opens it
        finally:
            await link.close()

    stack.run(scenario(), timeout=60.0)


async def until(condition, what: str) -> None:
    for _ in range(int(SETTLE_S / 0.01)):
        if condition():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"not within {SETTLE_S:.0f} s: {what}")


def test_a_request_waits_for_room_no_longer_than_its_bound_and_its_span_says_so(one_session_target):
    """With the target full and nobody ending a session, the refused call waits session_wait_s,
    then fails with the target's refusal; the wait is an event on the span current then, counting
    every refusal (with no wait allowed: the first call's, and the one retry's)."""
    for wait_s, least_ms in ((0.3, 300.0), (0.0, 0.0)):
        exporter = InMemorySpanExporter()
        provider = TracerProvider()
        provider.add_span_processor(SimpleSpanProcessor(exporter))
        one_session_target.run(_waits_then_fails(one_session_target, provider.get_tracer("test"), wait_s))
        (span,) = exporter.get_finished_spans()
        (event,) = [e for e in span.events if e.name == SESSION_WAIT_EVENT]
        assert event.attributes["specd.session_wait_ms"] >= least_ms and event.attributes["specd.opened"] is False
        if wait_s:
            assert event.attributes["specd.refusals"] >= 3  # 10 ms, then twice as long each time, within 300
        else:
            assert event.attributes["specd.refusals"] == 2


async def _waits_then_fails(stack, tracer, wait_s: float) -> None:
    link = TargetLink(f"127.0.0.1:{stack.target.port}", timeout_s=10.0, session_wait_s=wait_s)
    holder, refused = WorkerSession(f"session-wait-holder-{wait_s}"), WorkerSession(f"session-wait-refused-{wait_s}")
    try:
        await link.prefill(holder, PROMPT)
        with tracer.start_as_current_span("request"), pytest.raises(StatusError) as failed:
            await link.prefill(refused, PROMPT)
        assert failed.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED and NO_SESSION_ROOM in str(failed.value)
    finally:
        await link.end_session(holder.session_id)
        await link.close()
