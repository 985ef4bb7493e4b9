"""A request's rounds run one round ahead of their text.

The next round needs the last round's tokens, not their text: they are the target's, so they
are committed as soon as the round answers (up to the first EOS, which ends the request), and
the round after starts at once. Settling their text (a text thread's decode, the stop strings)
and handing the chunk to the caller (a stream's write) then overlap that round's worker calls
instead of standing between the two rounds. A stop string is the one end only the text shows:
the request ends there and what was committed past it is cut (`settled`).

The rounds run in a task of their own; a round starts once the caller has taken the round before
it, so they run at most one round ahead of the caller, and a slow reader holds them back as before.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from typing import AsyncIterator

from coordinator.request_state import RequestState
from coordinator.round_result import RoundResult


@dataclasses.dataclass(frozen=True)
class RoundAhead:
    """A round whose tokens are committed: the text behind them is still to settle."""

    result: RoundResult
    start: int  # len(committed) before the round's tokens
    tokens: list[int]  # the round's tokens up to its first EOS, committed already


_END = object()  # the rounds ended: the request's length is reached, or an EOS came


def until_eos(tokens: list[int], eos_token_ids: frozenset[int]) -> list[int]:
    """`tokens` up to and including the first EOS among them."""
    for count, token in enumerate(tokens, 1):
        if token in eos_token_ids:
            return tokens[:count]
    return tokens


class RoundsAhead:
    """Iterates a request's rounds (sd_rounds or ssd_rounds) as RoundAhead, run in a task that
    commits each round's tokens to `state.committed` before the next round starts. `close()`
    ends the task and the rounds (their calls in flight cancelled) before the request ends its
    worker sessions: a call reaching a worker after its EndSession would open the session again."""

    def __init__(self, rounds: AsyncIterator[RoundResult], state: RequestState):
        self._state = state
        self._ahead: asyncio.Queue = asyncio.Queue()  # at most one round in it: _run waits for each to be taken
        self._ended = False
        self._task = asyncio.ensure_future(self._run(rounds))

    def __aiter__(self) -> RoundsAhead:
        return self

    async def __anext__(self) -> RoundAhead:
        if self._ended:
            raise StopAsyncIteration
        item = await self._ahead.get()
        self._ahead.task_done()  # taken: the round after it may start
        if item is _END:
            self._ended = True
            raise StopAsyncIteration
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        return item

    async def _run(self, rounds: AsyncIterator[RoundResult]) -> None:
        state = self._state
        try:
            async with contextlib.aclosing(rounds):  # closed in this task, which iterated it
                async for result in rounds:
                    start = len(state.committed)
                    tokens = until_eos(result.tokens, state.eos_token_ids)
                    state.committed.extend(tokens)
                    state.policy.round_done(result.num_draft, len(result.tokens))
                    self._ahead.put_nowait(RoundAhead(result, start, tokens))
                    if tokens and tokens[-1] in state.eos_token_ids:
                        break  # the request's last round
                    # The next round starts once the caller has taken this one: it runs beside
                    # the caller's work on these tokens, and never further ahead.
                    await self._ahead.join()
            self._ahead.put_nowait(_END)
        except BaseException as exc:  # noqa: BLE001 - the caller gets it after the rounds before it
            # A cancellation too: one the request did not ask for (a call cancelled under the
            # round) ends it as it would have ended the request's own loop; close()'s is never read.
            self._ahead.put_nowait(exc)
            if not isinstance(exc, Exception):
                raise

    async def close(self) -> None:
        """End the rounds: a round under way is cancelled, and the rounds' own clean-up has run
        when this returns (unless the caller is cancelled meanwhile)."""
        self._state.trace.end_rounds()  # a round cut short now was ahead of the request's end
        self._task.cancel()
        await asyncio.wait([self._task])
        if not self._task.cancelled():
            self._task.exception()  # None: a failure went to the caller, or nobody asked for it
