"""SSD's adaptive sizing, with no gRPC in it: K from observed acceptance, the budget B from
measured throughput.

- K: the positions a draft token reaches with probability >= 0.1 under the running per-token
  acceptance a (a^K >= 0.1), capped by the request's K, and, while there is a tree, by the
  depth whose build fits in a verification: a build is K+1 forwards (step 0 and K tree steps),
  and a forward's measured time against the verification's bounds K.
- B: the tree's cost is not free on CPU, and it is paid twice when the draft and the target
  share cores (measured on an earlier demo pair with other jobs running on the machine: a
  16-branch build beside Verify doubled the verify's forward time; idle, it adds far less).
  Rather than model that, the coordinator measures what matters, milliseconds per emitted
  token, at its current budget and now and then at a neighbouring budget level, and moves
  when the probed level is clearly faster: measured against its own level on both sides of the
  probe (text that changes under it counts at most half), and by more than the rounds' scatter
  says chance would. What it learns is shared by all requests.
- A request's acceptance starts from the coordinator's recent rounds (all requests), not from
  a fixed guess: the first rounds' K and the fan-out of the trees beside them are sized before
  anything of the request is verified, and with a guess below the pair's acceptance the few
  branches went to early rejections while everything was accepted (traced at K = 8, when round
  0 still drafted: round 1 missed in most requests).
- A level whose measured build takes longer than the measured verification is not tried
  again from below (until that measure is old), and is left one level down at once if it is
  the current one (never down to 0 by this rule): a cache that arrives after the verification
  puts the draft back on the critical path.
"""

from __future__ import annotations

import collections
import dataclasses
import math

from specd import fanout as fanout_lib

# Acceptance (per token) before the coordinator has verified anything, and a request's prior's
# weight in rounds: the prior is the coordinator's recent acceptance.
_PRIOR_ACCEPTANCE, _PRIOR_WEIGHT = 0.7, 2.0
_DECAY = 0.9  # per round: recent rounds dominate a request's acceptance estimate
_SHARED_DECAY = 0.98  # per round, over all requests: a few requests' worth
_REACH = 0.1  # K covers the positions a draft token reaches with probability >= this
_LEVELS = (0, 1, 2, 4, 8, 12, 16, 24, 32, 48, 64, 96, 128)
_STAY_ROUNDS = 16  # rounds at the chosen level between probes, while probes win
_MAX_STAY_ROUNDS = 128  # each losing probe doubles the wait for the next, up to this
_PROBE_ROUNDS = 16  # rounds spent at a neighbouring level, then as many back at the kept one
_EMA = 0.2  # weight of a new sample in every running average here
_MARGIN = 0.97  # a probed level must be this much faster to be adopted
_Z = 2.33  # and faster by this many standard errors (one-sided 99%)
# Budget 0 must be clearly faster: its probe runs on whatever text comes, and where the text
# repeats itself prompt lookup drafts as well as the tree for a while, so a small lead at 0 is
# mostly the text; adopting 0 wrongly loses every cache hit (and verify-ahead) until it is left.
_ZERO_MARGIN = 0.9
_BUILD_MEMORY = 256  # builds after which a level's build time is retried rather than trusted
_ZERO_EVERY, _MAX_ZERO_EVERY = 3, 48  # probes between jumps to budget 0: doubled each time 0 loses


def _ema(average: float | None, sample: float) -> float:
    """The running average after `sample`; the first sample starts it."""
    return sample if average is None else (1 - _EMA) * average + _EMA * sample


@dataclasses.dataclass
class Acceptance:
    """Per-token acceptance from decayed counts: the capped-geometric maximum-likelihood estimate
    (accepted tokens over accepted tokens plus rejections)."""

    decay: float
    accepted: float  # decayed sum of accepted tokens
    rejected: float  # decayed count of rejections

    @classmethod
    def starting_at(cls, rate: float, decay: float) -> "Acceptance":
        """A prior of `rate`, weighing as much as _PRIOR_WEIGHT rounds."""
        return cls(decay, rate * _PRIOR_WEIGHT, (1 - rate) * _PRIOR_WEIGHT)

    @property
    def rate(self) -> float:
        return self.accepted / (self.accepted + self.rejected)

    def observe(self, num_draft: int, accepted: int) -> None:
        if num_draft == 0:
            return
        self.accepted = self.accepted * self.decay + accepted
        self.rejected = self.rejected * self.decay + (1.0 if accepted < num_draft else 0.0)


@dataclasses.dataclass
class Sizing:
    """The budget chosen by measured throughput; one per coordinator, shared by requests."""

    max_budget: int
    levels: list[int] = dataclasses.field(init=False)
    current: int = dataclasses.field(init=False)  # index into levels
    probe: int | None = None  # index being tried, if any
    probe_down: bool = True  # the next neighbour probe's direction: kept while probes win
    probes_since_zero: int = 0  # every zero_every-th probe jumps to budget 0 (no tree: every round takes the backup)
    zero_every: int = _ZERO_EVERY  # from 0 every probe goes back up
    last_nonzero: int = 0  # index of the last nonzero level kept
    rounds: int = 0  # rounds since the last decision (or the probe's end)
    trial: "_Trial | None" = None  # the probe under way, or being judged by the rounds after it
    recent: collections.deque = dataclasses.field(default_factory=lambda: collections.deque(maxlen=_PROBE_ROUNDS))  # (ms, tokens) at the current level
    stay_rounds: int = _STAY_ROUNDS  # rounds at the chosen level before the next probe
    build_ms: dict[int, float] = dataclasses.field(default_factory=dict)  # level -> EMA of the tree build
    builds: int = 0  # builds observed, at any level
    build_seen: dict[int, int] = dataclasses.field(default_factory=dict)  # level -> `builds` at its last build
    verify_ms: float | None = None  # EMA of the target's verify forward
    build_step_ms: float | None = None  # EMA of one build forward (a build's time / its forwards)
    acceptance: "Acceptance" = dataclasses.field(  # all requests'
        default_factory=lambda: Acceptance.starting_at(_PRIOR_ACCEPTANCE, _SHARED_DECAY)
    )

    def __post_init__(self) -> None:
        self.levels = sorted({b for b in _LEVELS if b <= self.max_budget} | {self.max_budget})
        self.current = self.last_nonzero = len(self.levels) - 1  # start at the configured budget

    @property
    def budget(self) -> int:
        return self.levels[self.probe if self.probe is not None else self.current]

    def fits(self, index: int) -> bool:
        """Whether level `index`'s build is not known to outlast a verification. What is known
        expires: a level is measured only while in use, and a slow spell of the machine (or of
        the draft beside a longer verification) would otherwise keep it out for good."""
        level = self.levels[index]
        built = self.build_ms.get(level)
        if built is None or self.verify_ms is None:
            return True
        return built <= self.verify_ms or self.builds - self.build_seen[level] > _BUILD_MEMORY

    def max_depth(self) -> int | None:
        """The most tree steps (K) whose build, with its step 0, fits in a verification."""
        if self.build_step_ms is None or self.verify_ms is None:
            return None
        return max(1, int(self.verify_ms / self.build_step_ms) - 1)

    def observe_build(self, budget: int, build_ms: float, verify_ms: float, forwards: int = 1) -> None:
        """One finished tree build's forward time (`forwards` forwards), and the verification it
        ran beside."""
        step = build_ms / max(1, forwards)
        self.build_step_ms = _ema(self.build_step_ms, step)
        self.build_ms[budget] = _ema(self.build_ms.get(budget), build_ms)
        self.builds += 1
        self.build_seen[budget] = self.builds
        self.verify_ms = _ema(self.verify_ms, verify_ms)
        # One level down now, but not to 0 this way: a tree's depth (K forwards) costs more
        # than its width, so a smaller budget may not fit either, and whether no cache at all
        # beats a late one is for the measured throughput to tell.
        if self.probe is None and self.current > 1 and not self.fits(self.current):
            self.current -= 1
            self.rounds = 0
            self.last_nonzero = self.current
            self.trial = None  # its rounds after the probe were to measure the level just left
            self.recent.clear()

    def observe(self, budget: int, round_ms: float, tokens: int) -> None:
        """One round's wall time and emitted tokens, at the budget it speculated with."""
        if tokens <= 0 or budget not in self.levels:
            return
        self.rounds += 1
        sample = (round_ms, float(tokens))
        at_current = budget == self.levels[self.current]
        trial = self.trial
        if trial is not None and self.probe is not None:  # the probe's rounds
            if budget == self.levels[self.probe]:
                trial.probe.append(sample)
            if self.rounds >= _PROBE_ROUNDS:
                self.probe, self.rounds = None, 0  # back to the kept level, to measure it after
            return
        if at_current:
            self.recent.append(sample)
        if trial is not None:  # the kept level's rounds after the probe
            if at_current:
                trial.after.append(sample)
            if self.rounds >= _PROBE_ROUNDS:
                self._judge(trial)
                self.trial, self.rounds = None, 0
        elif self.rounds >= self.stay_rounds and len(self.levels) > 1:
            self._start_probe()
            self.rounds = 0

    def _start_probe(self) -> None:
        self.probes_since_zero += 1
        if self.current == 0:
            # From no tree, a neighbour (one or two branches) hardly ever hits, so it cannot
            # show whether a tree pays: try the last good level outright.
            probe = self.last_nonzero
        elif self.probes_since_zero >= self.zero_every:
            # A plateau of nonzero levels (the tree's mere presence slows the target) hides
            # budget 0 from a neighbour search: try it outright. Each probe at 0 misses every
            # cache lookup (and the round after it), so one that loses waits twice as long.
            probe, self.probes_since_zero = 0, 0
        else:
            step = -1 if self.probe_down else 1
            neighbour = self.current + step
            if not (0 <= neighbour < len(self.levels) and self.fits(neighbour)):
                self.probe_down = not self.probe_down  # that way is closed: the other one
                neighbour = self.current - step
            probe = neighbour if 0 <= neighbour < len(self.levels) else self.current
        if probe == self.current:
            return
        self.probe, self.trial = probe, _Trial(probed=self.levels[probe], before=list(self.recent))

    def _judge(self, trial: "_Trial") -> None:
        """Adopt the probed level if it beat the kept level measured around it, by its margin
        and by more than the rounds' own scatter says chance would.

        Around it, before and after: text that changes under a probe (a stretch that repeats
        itself drafts twice as many tokens per round) changes the rounds after it too. And
        beyond chance: over a probe's rounds the text alone moves ms per token by tens of percent
        (logged at K = 4, the budget walked 16 -> 0 one noisy probe at a time), far more than
        a few branches more or less do; a level is left for one that is clearly faster."""
        tried, kept = trial.probed, self.levels[self.current]
        probe_cost, probe_error = _cost(trial.probe)
        kept_cost, kept_error = _cost(trial.before + trial.after)
        margin = _ZERO_MARGIN if tried == 0 else _MARGIN
        lead = kept_cost - probe_cost
        if probe_cost < margin * kept_cost and lead > _Z * math.hypot(probe_error, kept_error):
            self.current = self.levels.index(tried)  # and probe further the same way
            self.recent = collections.deque(trial.probe, maxlen=_PROBE_ROUNDS)
            if self.current != 0:
                self.last_nonzero = self.current
            self.stay_rounds = _STAY_ROUNDS
            if tried == 0 or kept == 0:
                self.zero_every = _ZERO_EVERY
        else:
            if tried == 0:
                self.zero_every = min(2 * self.zero_every, _MAX_ZERO_EVERY)
            # A settled level is probed away from less and less often: a probe costs rounds
            # at a worse budget (a probe at 0 loses every cache hit it would have had).
            self.probe_down = not self.probe_down
            self.stay_rounds = min(2 * self.stay_rounds, _MAX_STAY_ROUNDS)


def _cost(samples: list[tuple[float, float]]) -> tuple[float, float]:
    """Rounds' ms per token and its standard error; inf, inf without two rounds.

    A ratio of sums (an average of per-round ratios would overweight short, missed rounds), and
    the ratio estimator's error: the scatter of ms - cost * tokens over the rounds."""
    if len(samples) < 2:
        return math.inf, math.inf
    total_ms = sum(ms for ms, _ in samples)
    total_tokens = sum(tokens for _, tokens in samples)
    cost = total_ms / total_tokens
    n = len(samples)
    scatter = sum((ms - cost * tokens) ** 2 for ms, tokens in samples) / (n - 1)
    return cost, math.sqrt(scatter / n) / (total_tokens / n)


@dataclasses.dataclass
class _Trial:
    """A probe being judged: its own rounds, and the kept level's around them."""

    probed: int  # the level probed
    before: list[tuple[float, float]]  # the kept level's last rounds before the probe: (ms, tokens)
    probe: list[tuple[float, float]] = dataclasses.field(default_factory=list)
    after: list[tuple[float, float]] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Tuning:
    """One request's acceptance estimate, and the K and fan-out that follow from it."""

    max_k: int
    max_budget: int
    adaptive: bool
    sizing: Sizing | None = None
    previous_budget: int | None = None  # the budget the previous round speculated with
    own: Acceptance = dataclasses.field(init=False)  # this request's

    def __post_init__(self) -> None:
        prior = self.sizing.acceptance.rate if self.sizing is not None else _PRIOR_ACCEPTANCE
        self.own = Acceptance.starting_at(prior, _DECAY)

    @property
    def budget(self) -> int:
        if not self.adaptive or self.sizing is None:
            return self.max_budget
        return min(self.sizing.budget, self.max_budget)

    @property
    def acceptance(self) -> float:
        """The request's per-token acceptance."""
        return self.own.rate

    def observe_round(self, num_draft: int, accepted: int) -> None:
        self.own.observe(num_draft, accepted)
        if self.sizing is not None:
            self.sizing.acceptance.observe(num_draft, accepted)

    def observe_time(self, budget: int, round_ms: float, tokens: int) -> None:
        """A round's time is spent at its own budget (the tree beside its Verify), but its
        tokens came from the previous round's (a hit or a miss): only a round whose
        predecessor speculated with the same budget measures that budget."""
        previous, self.previous_budget = self.previous_budget, budget
        if self.adaptive and self.sizing is not None and previous == budget:
            self.sizing.observe(budget, round_ms, tokens)

    def observe_build(self, budget: int, build_ms: float, verify_ms: float, forwards: int) -> None:
        if self.adaptive and self.sizing is not None and budget > 0:
            self.sizing.observe_build(budget, build_ms, verify_ms, forwards)

    @property
    def k(self) -> int:
        """K for the next round: positions reached with probability >= _REACH, within max_k and,
        while a tree is built, within the depth whose build fits in a verification."""
        if not self.adaptive:
            return self.max_k
        a = min(max(self.acceptance, 0.05), 0.99)
        k = max(1, min(self.max_k, math.ceil(math.log(_REACH) / math.log(a))))
        depth = self.sizing.max_depth() if self.sizing is not None and self.budget > 0 else None
        return k if depth is None else min(k, depth)

    def fanout(self, num_draft: int, vocab_size: int, r: float) -> list[int]:
        return fanout_lib.allocate(self.acceptance, num_draft, self.budget, vocab_size, r)
