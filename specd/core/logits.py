"""Logits processing and sampling over a vocabulary, as tensors.

The same processing as transformers' logits processors and warpers (repetition penalty, then
temperature, top-k and top-p), so the target's distributions are those plain sampling draws
from; the uniforms come keyed (specd/core/sampling.py), never from a generator.
"""

from __future__ import annotations

from typing import Sequence

import torch

from specd.core.sampling import Purpose, SamplingSettings, SparseDist, keyed_uniform


def keyed_uniforms(seed: int, start: int, count: int, purpose: Purpose, device=None) -> torch.Tensor:
    """Uniforms for positions start..start+count-1, as a float64 tensor [count] on `device`."""
    values = [keyed_uniform(seed, start + i, purpose) for i in range(count)]
    return torch.tensor(values, dtype=torch.float64, device=device)


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
    """penalize_repeats with the history given as its distinct ids (seen_ids): [R, V] -> [R, V].
    Which tokens a row adds is worked out on the host, from the ids it was given: only the
    columns to change are indexed on the logits' device."""
    out = logits.clone()
    seen_here = seen.to(logits.device)  # [S]
    out[:, seen_here] = _penalized(out[:, seen_here], penalty)  # [R, S]
    known = set(seen.tolist())
    for row, tokens in enumerate(row_tokens):
        extra = sorted(set(tokens) - known)  # penalised once, as a token seen twice is
        if extra:
            columns = torch.tensor(extra, dtype=torch.long, device=logits.device)  # [E]
            out[row, columns] = _penalized(out[row, columns], penalty)
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


def sparse_to_dense(dists: list[SparseDist], vocab_size: int, device=None) -> torch.Tensor:
    """Scatter sparse distributions into a dense float32 tensor [len(dists), V] on `device`."""
    dense = torch.zeros(len(dists), vocab_size, dtype=torch.float32, device=device)
    for row, dist in enumerate(dists):
        ids = torch.tensor(dist.token_ids, dtype=torch.long, device=device)  # [N]
        dense[row, ids] = torch.tensor(dist.probs, dtype=torch.float32, device=device)
    return dense
