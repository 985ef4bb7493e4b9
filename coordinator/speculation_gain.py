"""Whether speculation pays for one request, measured on it: `auto` decodes target-only where it does not.

A draft proposes what it learnt from the target's own output. Where a request's text is unlike
that (a repetition penalty reshapes every distribution the draft learnt; text in a language or a
style it never saw; a high temperature), few drafted tokens are accepted, and a round of
speculation (the draft's work, a verify of K + 1 tokens) can cost more than the tokens it yields:
the request then decodes slower than the target alone would (README, "Calling Generate": the
default pair under a repetition penalty of 1.2).

So a request whose mode is `auto` measures both on itself. It speculates for a window of rounds,
then decodes a few rounds target-only (a probe), and compares the tokens per second of the two
stretches (the first round of each left out: it pays for the switch, a draft catching up or a
tree not yet built). Until speculation has won a comparison, a speculative stretch whose
measured rounds yield fewer than FEW_TOKENS tokens a round ends after EARLY_ROUNDS of them and
goes to the probe at once: such rounds rarely pay, and each costs more than a target-only step.
While speculation wins, each window before the next probe is GROWTH times
the last (up to MAX_WINDOW rounds), so a request it pays for spends little time probing. While
target-only wins, the request decodes target-only for a window that grows likewise, then
probes speculation again. The decision is the request's own: its text is what decides.
A request that names a mode gets that mode in every round (the load policy aside, load.py).

Greedy output does not depend on which rounds speculate (the exactness contract); sampled output
follows the target's distribution in every round either way.
"""

from __future__ import annotations

import dataclasses
import time

from coordinator.load import NO_GAIN, SpeculationLoad

FIRST_WINDOW = 16  # speculative rounds before the first probe
MAX_WINDOW = 256  # the longest a request goes between probes
GROWTH = 4  # each window the same kind wins, over the last: 16, 64, 256 rounds
OFF_PROBE = 4  # target-only rounds in a probe (the first one not measured): their cost hardly varies
SPECULATION_PROBE = 8  # speculative rounds in a probe (the first one not measured): acceptance varies
EARLY_ROUNDS = 4  # measured speculative rounds after which a stretch that yields too few tokens ends
# Tokens per speculative round below which such a stretch ends early. An ssd round of the default
# pair took 1.5-1.75 times a target-only round on two CPU cores (tools/time_modes.py, 2026-11-29:
# 53-64 ms against 35-36 ms), so fewer than 1.5 tokens a round lose there whatever the round's
# other costs. Only the probe comes sooner: it still decides by the rates it measures, and once
# speculation has won (a verify that costs less, on a GPU), its stretches run their length.
FEW_TOKENS = 1.5


@dataclasses.dataclass
class _Stretch:
    """Consecutive rounds of one kind: how many are left, and what the measured ones yielded."""

    speculates: bool
    rounds_left: int
    seen: int = 0
    tokens: int = 0
    ms: float = 0.0

    def yields_few(self) -> bool:
        """Speculative, and its measured rounds, EARLY_ROUNDS or more, yielded few tokens each."""
        measured = self.seen - 1
        return self.speculates and measured >= EARLY_ROUNDS and self.tokens < FEW_TOKENS * measured

    def rate(self) -> float | None:
        """Tokens per ms over the measured rounds; None before any."""
        return self.tokens / self.ms if self.ms > 0 else None


class SpeculationGain:
    """A request's draft tokens and tree budget per round, as its SpeculationLoad gives them, or
    none while target-only decoding is measured to be faster for it (or is being probed)."""

    def __init__(self, load: SpeculationLoad, first_window: int | None = None):
        self.load = load
        self.running = load.running
        self._window = first_window or FIRST_WINDOW  # the current main stretch's length
        self._stretch = _Stretch(True, self._window)
        self._probing = False
        self._rates = {True: None, False: None}  # the latest measured rate of each kind
        self._speculation_won = False  # the latest comparison's winner was speculation

    def k(self, asked: int) -> int:
        return self.load.k(asked) if self._stretch.speculates else 0

    def budget(self, asked: int) -> int:
        return self.load.budget(asked) if self._stretch.speculates else 0

    def target_only(self) -> str:
        """Why a round drafts nothing now: the load policy's reason if it has one (the round
        would draft nothing whatever this request measured), else NO_GAIN while target-only
        decoding runs (a main stretch, or a probe of it)."""
        return self.load.target_only() or ("" if self._stretch.speculates else NO_GAIN)

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
        if stretch.rounds_left <= 0 or (not self._speculation_won and stretch.yields_few()):
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


class RoundClock:
    """Feeds a request's SpeculationGain each round as it ends: whether it drafted, its tokens,
    and the wall time since the round before it ended (rounds overlap in ssd: the time between
    their ends is what the request's throughput is made of)."""

    def __init__(self, gain: SpeculationGain):
        self.gain = gain
        self._last = time.perf_counter()

    def observe(self, num_draft: int, tokens: int) -> None:
        """A round ended that drafted `num_draft` tokens and yielded `tokens`."""
        now = time.perf_counter()
        self.gain.observe(num_draft > 0, tokens, (now - self._last) * 1000.0)
        self._last = now
