"""Sampling settings, keyed randomness and sparse distributions: plain types, no torch.

Randomness is a pure function of (request seed, absolute position, purpose), not
a generator held by one worker, so a seeded request draws the same numbers on any
worker, after any restart, on every tensor-parallel rank. The tensor side of sampling
(logits processing, inverse-CDF draws over a vocabulary) is specd/core/logits.py.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import struct

# The lowest temperature above 0 that a request may ask for (0 itself is greedy). Lower ones are
# greedy in effect, and tiny ones (1e-38) overflow the scaled logits to inf and the softmax to
# NaN; the coordinator and both workers refuse them (specd/wire/convert.py check_sampling).
MIN_TEMPERATURE = 0.01
# The same bound as a float32, as temperature travels on the wire: 0.01 sent is 0.0099999998.
_MIN_TEMPERATURE_WIRE = struct.unpack("<f", struct.pack("<f", MIN_TEMPERATURE))[0]
# The repetition penalty divides positive logits and multiplies negative ones: past these bounds a
# float32 logit could overflow to inf after the penalty and the temperature (a penalty of 1e-38
# made the probabilities NaN), while no penalty anyone uses (1.0-1.5) comes near them.
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
_MIN_REPETITION_PENALTY_WIRE = struct.unpack("<f", struct.pack("<f", MIN_REPETITION_PENALTY))[0]


@dataclasses.dataclass(frozen=True)
class SamplingSettings:
    """Resolved sampling parameters: every field set."""

    temperature: float = 0.0  # 0 = greedy
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1 = off
    seed: int = 0
    repetition_penalty: float = 1.0  # 1 = off; > 1 discourages every token the history holds

    @property
    def penalizes(self) -> bool:
        return self.repetition_penalty != 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def sampling_problem(settings: SamplingSettings) -> str | None:
    """Why `settings` cannot reach a sampler (a message naming the field), or None if they can."""
    temperature = settings.temperature
    if not math.isfinite(temperature) or not (temperature == 0.0 or temperature >= _MIN_TEMPERATURE_WIRE):
        return f"temperature must be 0 (greedy) or a finite number >= {MIN_TEMPERATURE}, got {temperature}"
    if settings.top_k < 0:
        return f"top_k must be >= 0 (0 = off), got {settings.top_k}"
    if not 0 < settings.top_p <= 1:  # also refuses NaN
        return f"top_p must lie in (0, 1] (1 = off), got {settings.top_p}"
    penalty = settings.repetition_penalty
    if not _MIN_REPETITION_PENALTY_WIRE <= penalty <= MAX_REPETITION_PENALTY:  # also refuses NaN
        return f"repetition_penalty must lie in [{MIN_REPETITION_PENALTY}, {MAX_REPETITION_PENALTY:g}] (1 = off), got {penalty}"
    return None


class Purpose(enum.IntEnum):
    """What a random number is for; each purpose draws an independent stream."""

    DRAFT = 1  # the draft samples d_i from q
    ACCEPT = 2  # the ratio test's uniform for d_i
    SAMPLE = 3  # the target samples a recovered or bonus token


_TWO_POW_53 = float(1 << 53)


def keyed_uniform(seed: int, position: int, purpose: Purpose) -> float:
    """A uniform number in [0, 1) that depends only on its key."""
    key = struct.pack("<QQB", seed & 0xFFFFFFFFFFFFFFFF, position, int(purpose))
    word = int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little")
    return (word >> 11) / _TWO_POW_53


@dataclasses.dataclass(frozen=True)
class SparseDist:
    """A distribution over its support: token ids and probabilities summing to 1."""

    token_ids: list[int]
    probs: list[float]


def sample_sparse(dist: SparseDist, uniform: float) -> int:
    """Draw from a sparse distribution with one uniform (inverse CDF over its support)."""
    cumulative = 0.0
    target = uniform * sum(dist.probs)
    for token, prob in zip(dist.token_ids, dist.probs):
        cumulative += prob
        if target < cumulative and prob > 0:
            return token
    for token, prob in zip(reversed(dist.token_ids), reversed(dist.probs)):
        if prob > 0:
            return token
    # Not StopIteration (a bare next()): raised on a model thread it cannot be set on the
    # asyncio future that awaits the call, which then never completes.
    raise ValueError("the distribution has no positive probability to sample from")
