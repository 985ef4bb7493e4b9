"""The rounds of a request run one round ahead of their text (coordinator/rounds_ahead.py)."""

from __future__ import annotations

import asyncio

import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from coordinator.round_result import RoundResult
from coordinator.round_trace import UNUSED_ROUND, RoundTrace
from coordinator.rounds_ahead import RoundsAhead, until_eos
from tests.request_states import request_state

EOS = 2


def _result(index: int, tokens: list[int]) -> RoundResult:
    return RoundResult(index, "off", tokens, [], 0, 0, False, 0.0, 1.0, "")


class _Rounds:
    """A round loop that emits the given tokens round by round, noting what was committed when
    each round started and whether it was closed."""

    def __init__(self, state, rounds: list[list[int]], fail_at: int | None = None, hang_at: int | None = None,
                 failure: BaseException = RuntimeError("target unavailable")):
        self.state, self.rounds, self.fail_at, self.hang_at, self.failure = state, rounds, fail_at, hang_at, failure
        self.seen: list[list[int]] = []  # committed as each round started
        self.closed = False
        self.cancelled = False

    async def run(self):
        try:
            for index, tokens in enumerate(self.rounds):
                self.seen.append(list(self.state.committed))
                if index == self.fail_at:
                    raise self.failure
                with self.state.trace.round(index):
                    if index == self.hang_at:
                        try:
                            await asyncio.Event().wait()
                        except asyncio.CancelledError:
                            self.cancelled = True
                            raise
                yield _result(index, tokens)
        finally:
            self.closed = True


def _run(coroutine):
    return asyncio.run(asyncio.wait_for(coroutine, 10))


def test_until_eos():
    assert until_eos([5, 6, 7], frozenset({EOS})) == [5, 6, 7]
    assert until_eos([5, EOS, 7, EOS], frozenset({EOS})) == [5, EOS]
    assert until_eos([5, EOS], frozenset()) == [5, EOS]


def test_each_round_starts_after_the_last_rounds_tokens_before_the_caller_takes_them():
    async def main():
        state = request_state([1, 1], mode="off")
        rounds = _Rounds(state, [[3, 4], [5], [6, 7, 8]])
        ahead = RoundsAhead(rounds.run(), state)
        first = await ahead.__anext__()
        await asyncio.sleep(0.01)  # the caller is slow: the rounds do not wait for it, one round ahead
        assert rounds.seen == [[1, 1], [1, 1, 3, 4]] and state.committed == [1, 1, 3, 4, 5]
        taken = [first] + [item async for item in ahead]
        assert [(a.start, a.tokens) for a in taken] == [(2, [3, 4]), (4, [5]), (5, [6, 7, 8])]
        assert state.committed == [1, 1, 3, 4, 5, 6, 7, 8] and rounds.closed
        await ahead.close()

    _run(main())


def test_an_eos_ends_the_rounds_and_what_follows_it_is_not_committed():
    async def main():
        state = request_state([1], mode="off")
        state.eos_token_ids = frozenset({EOS})
        rounds = _Rounds(state, [[3], [4, EOS, 9], [5]])
        taken = [item async for item in RoundsAhead(rounds.run(), state)]
        assert [a.tokens for a in taken] == [[3], [4, EOS]] and taken[1].result.tokens == [4, EOS, 9]
        assert state.committed == [1, 3, 4, EOS]
        assert len(rounds.seen) == 2 and rounds.closed  # no round after the EOS

    _run(main())


def test_a_failed_round_reaches_the_caller_after_the_rounds_before_it():
    async def main():
        state = request_state([1], mode="off")
        rounds = _Rounds(state, [[3], [4], [5]], fail_at=2)
        ahead = RoundsAhead(rounds.run(), state)
        assert [(await ahead.__anext__()).tokens for _ in range(2)] == [[3], [4]]
        with pytest.raises(RuntimeError, match="target unavailable"):
            await ahead.__anext__()
        assert rounds.closed
        await ahead.close()

    _run(main())


def test_a_cancellation_under_a_round_ends_the_request_instead_of_leaving_it_waiting():
    async def main():
        state = request_state([1], mode="off")
        rounds = _Rounds(state, [[3], [4]], fail_at=1, failure=asyncio.CancelledError("a call cancelled under the round"))
        ahead = RoundsAhead(rounds.run(), state)
        await ahead.__anext__()
        with pytest.raises(asyncio.CancelledError, match="a call cancelled under the round"):
            await asyncio.wait_for(ahead.__anext__(), 5)
        await ahead.close()

    _run(main())


def test_close_cancels_the_round_under_way_which_is_named_unused_and_closes_the_loop_before_it_returns():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("test")

    async def main():
        with tracer.start_as_current_span("llm_request"):
            state = request_state([1], mode="off")
            state.trace = RoundTrace(tracer)
            rounds = _Rounds(state, [[3], [4], [5]], hang_at=1)
            ahead = RoundsAhead(rounds.run(), state)
            await ahead.__anext__()
            await asyncio.sleep(0.01)  # round 1 is under way
            await ahead.close()
            assert rounds.cancelled and rounds.closed and len(rounds.seen) == 2

    _run(main())
    names = {s.attributes["specd.round.index"]: s.name for s in exporter.get_finished_spans() if s.name != "llm_request"}
    assert names == {0: "spec_round", 1: UNUSED_ROUND}


def test_a_caller_that_takes_nothing_holds_the_rounds_one_round_ahead():
    async def main():
        state = request_state([1], mode="off")
        rounds = _Rounds(state, [[t] for t in range(3, 13)])
        ahead = RoundsAhead(rounds.run(), state)
        await asyncio.sleep(0.05)
        assert len(rounds.seen) == 1 and state.committed == [1, 3]  # round 0 waits to be taken; no round 1
        await ahead.close()
        assert rounds.closed

    _run(main())
