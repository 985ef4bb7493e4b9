"""Plain reference forms of what specd computes batched (the draft's truncation and Saguaro
reshaping of q), for tests that check the batched forms and the exactness of what they send."""

from __future__ import annotations

import torch

from specd.core.sampling import SparseDist


def truncate_to_top(probs: torch.Tensor, max_support: int) -> SparseDist:
    """Keep the top-N tokens of probs [V] with positive mass and renormalise."""
    count = min(max_support, int((probs > 0).sum()))
    top = torch.topk(probs, count)
    kept = top.values / top.values.sum()
    return SparseDist(token_ids=top.indices.tolist(), probs=kept.tolist())


def reshape(dist: SparseDist, top_f: int, c: float) -> SparseDist:
    """q': multiply the top-`top_f` probabilities of `dist` by c and renormalise.

    Returns `dist` unchanged when there is nothing to reshape (c = 1, top_f = 0) or when the
    reshaped mass would vanish (c = 0 and the whole support is in the top F).
    """
    assert 0.0 <= c <= 1.0, c
    if c == 1.0 or top_f <= 0 or len(dist.token_ids) <= 1:
        return dist
    order = sorted(range(len(dist.probs)), key=lambda i: -dist.probs[i])
    top = set(order[:top_f])
    weighted = [p * c if i in top else p for i, p in enumerate(dist.probs)]
    total = sum(weighted)
    if total <= 0.0:
        return dist
    return SparseDist(token_ids=list(dist.token_ids), probs=[w / total for w in weighted])
