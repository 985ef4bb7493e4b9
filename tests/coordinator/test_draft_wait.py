"""How long a round waits for the draft (coordinator/draft_wait.py), and what a draft that does
not answer in time becomes: down, asked nothing, probed in the background.

tests/e2e/test_chaos.py stops and kills real worker processes; these are the rules underneath.
"""

from __future__ import annotations

import asyncio
import socket

import pytest

from coordinator.config import CoordinatorConfig
from coordinator.draft_link import DraftFailed, DraftLink
from coordinator.draft_wait import DraftWait, answer_within
from specd.core.config import ConfigError


def test_the_bound_scales_with_the_slower_worker_call_and_keeps_its_floor():
    wait = DraftWait(verifies=4.0, min_ms=100.0)
    assert wait.seconds(None, None) == pytest.approx(0.1)  # nothing measured yet: the floor
    assert wait.seconds(10.0, None) == pytest.approx(0.1)  # 4 x 10 ms is under the floor
    assert wait.seconds(50.0, None) == pytest.approx(0.2)
    assert wait.seconds(50.0, 200.0) == pytest.approx(0.8)  # a draft busy on every call gets room


@pytest.mark.parametrize("field, value", [("draft_wait_verifies", 0.0), ("draft_wait_min_ms", -1.0)])
def test_the_wait_settings_are_checked(field, value):
    with pytest.raises(ConfigError):
        CoordinatorConfig(**{field: value}).validate()


def test_a_draft_that_does_not_answer_in_time_is_down_without_any_round_waiting():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed_port = probe.getsockname()[1]

    async def scenario() -> None:
        draft = DraftLink(f"127.0.0.1:{closed_port}", timeout_s=30.0, retry_s=0.05)
        draft.info = object()  # as if it had answered before: up
        try:
            with pytest.raises(DraftFailed, match="did not answer within 50 ms"):
                await answer_within(draft, asyncio.sleep(30.0), 0.05)
            assert not draft.usable()  # down; usable() is no coroutine: it never waits for the probe
            await asyncio.sleep(0.3)  # the probe asks in the background; nothing listens
            assert not draft.usable() and draft.info is None
        finally:
            await draft.close()

    asyncio.run(asyncio.wait_for(scenario(), 10.0))


def test_a_request_cancelled_as_the_draft_answers_stays_cancelled():
    """The caller went away in the same loop turn as the draft's answer came: the round must
    end, not go on with the answer (on Python 3.11, asyncio.wait_for returned the answer and
    dropped the cancellation, and the cancelled request decoded to its end)."""

    async def scenario() -> None:
        draft = DraftLink("127.0.0.1:1", timeout_s=30.0, retry_s=0.05)
        try:
            answer: asyncio.Future = asyncio.get_running_loop().create_future()
            waiting = asyncio.ensure_future(answer_within(draft, answer, 5.0))
            await asyncio.sleep(0)  # the round now waits for the draft
            answer.set_result("drafted")
            waiting.cancel()  # before the loop's next turn, when the answer would be taken
            with pytest.raises(asyncio.CancelledError):
                await waiting
        finally:
            await draft.close()

    asyncio.run(asyncio.wait_for(scenario(), 10.0))
