"""How many prompt tokens the target's next forward may cache, so that it lasts about a set time.

A forward that caches a long stretch of a prompt holds the model thread for as long as that
takes: on a CPU, seconds for a 1,024-token worker call (README, "Long prompts"), and every other
session's verify waits behind it. With a time budget, the runner cuts such a catch-up to the tokens that
fit (the call runs again for the rest, AGAIN), so that the other sessions' verifies join a
forward every budget or so, whatever the device: the pacer turns the budget into tokens from
the milliseconds per token that the latest forwards caching at least `MIN_TOKENS` committed
tokens took (the cost per token grows with the context, so recent forwards are the guide; a
forward of verifies alone, a few tokens each, costs less per token than a prompt's and would
lead the pacer to cut too long a chunk). Until such a forward has been measured it allows
`first_tokens`.

The decision is made once, on the process that serves (rank 0 of a tensor-parallel target), and
passed to the runner, so that every rank cuts the same calls the same way.
"""

from __future__ import annotations

from target_service.runner import ForwardCost

MIN_TOKENS = 32  # a forward caching fewer committed tokens says little about what a prompt's tokens cost
FIRST_CHUNK_TOKENS = 256  # the first forward's allowance when no token count is set either
SMOOTHING = 0.5  # weight of the newest forward in the estimate (the context, and so the cost, grows as a prompt is cached)


class PrefillPacer:
    def __init__(self, budget_ms: float, first_tokens: int):
        self.budget_ms = budget_ms  # 0: no budget (the runner cuts by tokens only)
        self._first_tokens = first_tokens
        self._ms_per_token: float | None = None

    def most_tokens(self) -> int | None:
        """Most tokens the next forward may feed (at least MIN_TOKENS); None: no budget."""
        if self.budget_ms <= 0:
            return None
        if self._ms_per_token is None:
            return max(MIN_TOKENS, self._first_tokens)
        return max(MIN_TOKENS, int(self.budget_ms / self._ms_per_token))

    def observe(self, forward: ForwardCost) -> None:
        """A forward ran: what it fed and how long it took."""
        if forward.committed_tokens < MIN_TOKENS or forward.ms <= 0:
            return
        latest = forward.ms / forward.fed_tokens
        if self._ms_per_token is None:
            self._ms_per_token = latest
        else:
            self._ms_per_token = SMOOTHING * latest + (1 - SMOOTHING) * self._ms_per_token
