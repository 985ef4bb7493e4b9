"""coordinator.admission on its own event loop: first in, first out; a place given to a caller
that is leaving at that moment passes on; the default limit's sizing."""

from __future__ import annotations

import asyncio

import pytest

from coordinator.admission import DEFAULT_WORKER_SESSIONS, Admission, Overloaded, QueueDeadlineExceeded, running_limit


async def _queued(admission: Admission, count: int) -> list[asyncio.Task]:
    tasks = []
    for _ in range(count):
        tasks.append(asyncio.ensure_future(admission.admit()))
        await asyncio.sleep(0)  # each reaches the queue before the next is made
    return tasks


def test_places_go_first_in_first_out():
    async def scenario():
        admission = Admission(lambda: 1, max_queued=3)
        first = await admission.admit()
        tasks = await _queued(admission, 3)
        assert (admission.running, admission.waiting) == (1, 3)
        order = []
        place = first
        for _ in tasks:
            place.release()
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED, timeout=5)
            finished = [t for t in done if t not in order]
            assert len(finished) == 1  # one place freed, one waiter admitted
            order.append(finished[0])
            place = finished[0].result()
        assert order == tasks
        place.release()
        assert (admission.running, admission.waiting) == (0, 0)

    asyncio.run(scenario())


def test_past_the_queue_is_refused_with_the_limits_in_the_message():
    async def scenario():
        admission = Admission(lambda: 2, max_queued=1)
        places = [await admission.admit(), await admission.admit()]
        tasks = await _queued(admission, 1)
        with pytest.raises(Overloaded, match="^specd is serving its maximum of 2 requests with 1 queued; retry later$"):
            await admission.admit()
        for place in places:
            place.release()
        (await tasks[0]).release()
        assert (admission.running, admission.waiting) == (0, 0)

    asyncio.run(scenario())


def test_a_place_given_as_its_waiter_is_cancelled_passes_on():
    async def scenario():
        admission = Admission(lambda: 1, max_queued=2)
        first = await admission.admit()
        leaving, staying = await _queued(admission, 2)
        first.release()  # the place goes to `leaving`, which is cancelled before it resumes
        leaving.cancel()
        place = await asyncio.wait_for(staying, 5)
        assert leaving.cancelled()
        assert (admission.running, admission.waiting) == (1, 0)
        place.release()
        assert admission.running == 0

    asyncio.run(scenario())


def test_a_waiter_past_its_timeout_leaves_the_queue():
    async def scenario():
        admission = Admission(lambda: 1, max_queued=2)
        first = await admission.admit()
        with pytest.raises(QueueDeadlineExceeded, match="deadline passed"):
            await admission.admit(timeout_s=0.05)
        assert (admission.running, admission.waiting) == (1, 0)
        first.release()
        assert admission.running == 0

    asyncio.run(scenario())


def test_the_default_limit_is_the_smaller_cap_less_an_eighth():
    assert running_limit(0, [64, 64]) == 56
    assert running_limit(0, [64, 16]) == 14
    assert running_limit(0, [3, 0]) == 2  # 0: a worker that did not say
    assert running_limit(0, [1]) == 1
    assert running_limit(0, [0, 0]) == running_limit(0, [DEFAULT_WORKER_SESSIONS])
    assert running_limit(5, [64, 64]) == 5  # set explicitly: taken as it is
