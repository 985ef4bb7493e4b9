"""What the speculation policy (coordinator/policy.py) measures: a request's acceptance, what
rounds cost, and, for `auto`, whether speculating or not decodes the request faster.
"""

from __future__ import annotations

import dataclasses

# The `auto` comparison's stretches (rounds): a request speculates for a window, probes
# target-only decoding, and keeps the faster, each window the same kind wins GROWTH times the last.
FIRST_WINDOW = 16  # speculative rounds before the first probe
MAX_WINDOW = 256  # the longest a request goes between probes
GROWTH = 4  # 16, 64, 256 rounds
OFF_PROBE = 4  # target-only rounds in a probe (the first one not measured): their cost hardly varies
SPECULATION_PROBE = 8  # speculative rounds in a probe (the first one not measured): acceptance varies
EARLY_ROUNDS = 4  # measured speculative rounds after which a stretch that yields too few tokens ends

_COST_DECAY = 0.9  # per observation of a cost: the load changes, so do forwards' costs
# A verify's extra cost per extra token, as a fraction of a one-token verify, until two token
# counts have been measured (the default target on CPU: 5 tokens cost ~1.5x one).
_PRIOR_TOKEN_SLOPE = 0.125


@dataclasses.dataclass
class AcceptanceEstimate:
    """A request's per-token acceptance: the capped-geometric maximum-likelihood estimate from
    decayed counts (accepted tokens over accepted tokens plus rejections; a round that accepts
    all its draft tokens rejects none), a prior standing in before the first round."""

    prior: float  # per-token acceptance before any round
    prior_weight: float  # the prior's weight, in rounds
    decay: float  # per round: recent rounds dominate
    accepted: float = dataclasses.field(init=False)  # decayed sum of accepted tokens
    rejected: float = dataclasses.field(init=False)  # decayed count of rejections

    def __post_init__(self) -> None:
        self.accepted = self.prior * self.prior_weight
        self.rejected = (1 - self.prior) * self.prior_weight

    @property
    def value(self) -> float:
        """Per drafted token, given the ones before it were accepted."""
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_draft: int, accepted: int) -> None:
        """A round that drafted `num_draft` tokens and kept `accepted` (none drafted: nothing learnt)."""
        if num_draft == 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1.0 if accepted < num_draft else 0.0)


class _Average:
    """An exponentially decayed mean."""

    def __init__(self, decay: float):
        self.decay = decay
        self.total = 0.0
        self.weight = 0.0

    def add(self, value: float) -> None:
        self.total = self.total * self.decay + value
        self.weight = self.weight * self.decay + 1.0

    @property
    def value(self) -> float | None:
        return self.total / self.weight if self.weight > 0 else None


class RoundCosts:
    """What sd rounds cost, as the coordinator measured them: shared by every request."""

    def __init__(self) -> None:
        self._draft_ms_per_token = _Average(_COST_DECAY)
        self._verify_ms: dict[int, _Average] = {}  # tokens verified (K + 1) -> wall ms

    def observe(self, num_draft: int, draft_ms: float, verify_ms: float) -> None:
        """One round: its K, the time it waited on the draft, the verify call's wall time."""
        if num_draft > 0 and draft_ms > 0:
            self._draft_ms_per_token.add(draft_ms / num_draft)
        self._verify_ms.setdefault(num_draft + 1, _Average(_COST_DECAY)).add(verify_ms)

    def draft_ms(self, num_draft: int) -> float | None:
        per_token = self._draft_ms_per_token.value
        return None if per_token is None else per_token * num_draft

    def verify_ms(self, tokens: int) -> float | None:
        """A verify of `tokens` tokens: a line through the measured token counts (one
        measured count: the prior slope through it); None before any verify."""
        points = sorted((n, avg.value) for n, avg in self._verify_ms.items() if avg.value is not None)
        if not points:
            return None
        if len(points) == 1:
            n, ms = points[0]
            one_token_ms = ms / (1.0 + _PRIOR_TOKEN_SLOPE * (n - 1))
            return one_token_ms * (1.0 + _PRIOR_TOKEN_SLOPE * (tokens - 1))
        (n0, ms0), (n1, ms1) = points[0], points[-1]
        slope = max(0.0, (ms1 - ms0) / (n1 - n0))  # more tokens never verify faster
        return ms0 + slope * (tokens - n0)


def expected_tokens(acceptance: float, num_draft: int) -> float:
    """Tokens a round yields on average: accepted drafts plus the target's own, (1 - a^(K+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return float(num_draft + 1)
    return (1.0 - acceptance ** (num_draft + 1)) / (1.0 - acceptance)


def k_that_pays(cap: int, acceptance: float, costs: RoundCosts) -> int:
    """The K in 1..cap with the most expected tokens per ms of draft and verify; `cap` before
    anything is measured. At least one token: turning speculation off is the load's call."""
    best_k, best_rate = cap, None
    for k in range(1, cap + 1):
        verify_ms, draft_ms = costs.verify_ms(k + 1), costs.draft_ms(k)
        if verify_ms is None or draft_ms is None or verify_ms + draft_ms <= 0:
            return cap
        rate = expected_tokens(acceptance, k) / (verify_ms + draft_ms)
        if best_rate is None or rate > best_rate:
            best_k, best_rate = k, rate
    return best_k


@dataclasses.dataclass
class _Stretch:
    """Consecutive rounds of one kind: how many are left, and what the measured ones yielded."""

    speculates: bool
    rounds_left: int
    seen: int = 0
    tokens: int = 0
    ms: float = 0.0

    def yields_few(self, few_tokens: float) -> bool:
        """Speculative, and its measured rounds, EARLY_ROUNDS or more, yielded under `few_tokens` each."""
        measured = self.seen - 1
        return self.speculates and measured >= EARLY_ROUNDS and self.tokens < few_tokens * measured

    def rate(self) -> float | None:
        """Tokens per ms over the measured rounds; None before any."""
        return self.tokens / self.ms if self.ms > 0 else None


class GainComparison:
    """`auto`: whether speculation decodes this request faster than the target alone, measured on
    it. It speculates for a window of rounds, then decodes a few rounds target-only (a probe),
    and keeps the faster by tokens per second (each stretch's first round left out: it pays for
    the switch). Until speculation has won once, a speculative stretch whose rounds yield fewer
    than `few_tokens` each ends after EARLY_ROUNDS of them and goes to the probe at once."""

    def __init__(self, few_tokens: float, first_window: int | None = None):
        self.few_tokens = few_tokens
        self._window = first_window or FIRST_WINDOW  # the current main stretch's length
        self._stretch = _Stretch(True, self._window)
        self._probing = False
        self._rates: dict[bool, float | None] = {True: None, False: None}  # the latest measured rate of each kind
        self._speculation_won = False  # the latest comparison's winner was speculation

    @property
    def speculates(self) -> bool:
        """Whether the current stretch speculates."""
        return self._stretch.speculates

    def observe(self, drafted: bool, tokens: int, wall_ms: float) -> None:
        """A round ended: whether it drafted, the tokens it yielded and the wall time since the
        previous round ended. A round of the other kind (decided before the switch) is not counted."""
        stretch = self._stretch
        if drafted == stretch.speculates:
            if stretch.seen > 0:  # the stretch's first round pays for the switch
                stretch.tokens += tokens
                stretch.ms += wall_ms
            stretch.seen += 1
        stretch.rounds_left -= 1
        if stretch.rounds_left <= 0 or (not self._speculation_won and stretch.yields_few(self.few_tokens)):
            self._next_stretch()

    def _next_stretch(self) -> None:
        done = self._stretch
        rate = done.rate()
        if rate is not None:
            self._rates[done.speculates] = rate
        if not self._probing:  # a main stretch ended: probe the other kind
            self._start(not done.speculates, OFF_PROBE if done.speculates else SPECULATION_PROBE, probing=True)
            return
        speculation, plain = self._rates[True], self._rates[False]
        if speculation is None or plain is None:  # nothing to compare (the probe's rounds ran the other kind)
            winner = not done.speculates
        else:
            winner = speculation >= plain
            self._speculation_won = winner
        # The kind that ran before the probe wins again: its stretches grow; else the other's start anew.
        self._window = min(MAX_WINDOW, self._window * GROWTH) if winner != done.speculates else FIRST_WINDOW
        self._start(winner, self._window, probing=False)

    def _start(self, speculates: bool, rounds: int, probing: bool) -> None:
        self._stretch = _Stretch(speculates, rounds)
        self._probing = probing
