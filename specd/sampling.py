"""Logits processing, keyed randomness and sparse draft distributions.

Randomness is a pure function of (request seed, absolute position, purpose), not
a generator held by one worker, so a seeded request draws the same numbers on any
worker, after any restart, on every tensor-parallel rank.
"""

from __future__ import annotations

import dataclasses
import enum
import hashlib
import math
import struct
from typing import Sequence

import torch

# The lowest temperature above 0 that a request may ask for (0 itself is greedy). Lower ones are
# greedy in effect, and tiny ones (1e-38) overflow the scaled logits to inf and the softmax to
# NaN; the coordinator and both workers refuse them (specd/wire.py check_sampling).
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


def keyed_uniforms(seed: int, start: int, count: int, purpose: Purpose) -> torch.Tensor:
    """Uniforms for positions start..start+count-1, as a float64 tensor [count]."""
    values = [keyed_uniform(seed, start + i, purpose) for i in range(count)]
    return torch.tensor(values, dtype=torch.float64)


def penalize_repeats(
    logits: torch.Tensor, history: Sequence[int], row_tokens: Sequence[Sequence[int]], penalty: float
) -> torch.Tensor:
    """transformers' repetition penalty, row by row: every token seen before a row's position
    has its logit divided by `penalty` where positive, multiplied where negative. Row r has seen
    `history` (the tokens before the first row: the prompt and what was generated) and then
    `row_tokens[r]` (what it follows past them: the drafts before it, a branch's own tokens).

    logits: [R, V] float32 -> [R, V]. The same elementwise arithmetic as transformers'
    RepetitionPenaltyLogitsProcessor, so a row equals its result bit for bit. It comes before
    temperature, top-k and top-p (logits_to_probs), as processors come before warpers there.
    Only the seen tokens' columns are touched (a draft's tree step has a few rows over the whole
    vocabulary, and a pass over all of it cost a third of the step).
    """
    return penalize_seen(logits, seen_ids(history), row_tokens, penalty)


def seen_ids(history: Sequence[int]) -> torch.Tensor:
    """The distinct token ids of `history` [S]: what penalize_seen takes, found once by a caller
    that penalises many steps after the same history."""
    return torch.unique(torch.as_tensor(history, dtype=torch.long))


def penalize_seen(logits: torch.Tensor, seen: torch.Tensor, row_tokens: Sequence[Sequence[int]], penalty: float) -> torch.Tensor:
    """penalize_repeats with the history given as its distinct ids (seen_ids): [R, V] -> [R, V]."""
    out = logits.clone()
    out[:, seen] = _penalized(out[:, seen], penalty)  # [R, S]
    in_history = torch.zeros(logits.shape[-1], dtype=torch.bool)  # [V]
    in_history[seen] = True
    for row, tokens in enumerate(row_tokens):
        extra = torch.unique(torch.as_tensor(tokens, dtype=torch.long))  # [E]
        extra = extra[~in_history[extra]]  # penalised once, as a token seen twice is
        out[row, extra] = _penalized(out[row, extra], penalty)
    return out


def _penalized(scores: torch.Tensor, penalty: float) -> torch.Tensor:
    return torch.where(scores < 0, scores * penalty, scores / penalty)


def logits_to_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """Probabilities after temperature, top-k and top-p, as transformers' warpers apply them.

    logits: [..., V] -> probs [..., V] float32. Greedy settings give the one-hot of the argmax.
    """
    logits = logits.float()
    if settings.greedy:
        # [..., V] one-hot of the first maximum, as torch.argmax picks it.
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
    scores = logits / settings.temperature
    vocab = scores.shape[-1]
    if 0 < settings.top_k < vocab:
        kth = torch.topk(scores, settings.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, float("-inf"))
    if settings.top_p < 1.0:
        sorted_scores, order = torch.sort(scores, dim=-1, descending=False)  # [..., V]
        cumulative = sorted_scores.softmax(-1).cumsum(-1)  # [..., V]
        remove_sorted = cumulative <= (1.0 - settings.top_p)
        remove_sorted[..., -1] = False  # always keep the most likely token
        remove = remove_sorted.scatter(-1, order, remove_sorted)
        scores = scores.masked_fill(remove, float("-inf"))
    return scores.softmax(-1)


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling; probs may be unnormalised.

    probs: [B, V], uniforms: [B] in [0, 1) -> token ids [B] (int64).
    """
    cdf = probs.double().cumsum(-1)  # [B, V]
    targets = (uniforms.double() * cdf[:, -1]).unsqueeze(-1)  # [B, 1]
    # right=True: the first index whose cdf exceeds the target always has positive mass.
    tokens = torch.searchsorted(cdf, targets, right=True).squeeze(-1)  # [B]
    return tokens.clamp_(max=probs.shape[-1] - 1)


@dataclasses.dataclass(frozen=True)
class SparseDist:
    """A distribution over its support: token ids and probabilities summing to 1."""

    token_ids: list[int]
    probs: list[float]


def truncate_to_top(probs: torch.Tensor, max_support: int) -> SparseDist:
    """Keep the top-N tokens of probs [V] with positive mass and renormalise."""
    count = min(max_support, int((probs > 0).sum()))
    top = torch.topk(probs, count)
    kept = top.values / top.values.sum()
    return SparseDist(token_ids=top.indices.tolist(), probs=kept.tolist())


def sparse_to_dense(dists: list[SparseDist], vocab_size: int) -> torch.Tensor:
    """Scatter sparse distributions into a dense float32 tensor [len(dists), V]."""
    dense = torch.zeros(len(dists), vocab_size, dtype=torch.float32)
    for row, dist in enumerate(dists):
        dense[row, torch.tensor(dist.token_ids, dtype=torch.long)] = torch.tensor(
            dist.probs, dtype=torch.float32
        )
    return dense


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
