"""Saguaro sampling: the draft down-weights its top-F tokens so that rejections land on them.

When the draft's token d at a position is rejected, the target samples the recovered token
from norm(max(0, p - q)). If the draft samples from q' proportional to C*q on its top-F tokens
and q elsewhere (C in [0, 1]), the residual p - q' grows exactly on those F tokens, which are
the ones the speculation cache holds branches for: the hit rate rises and acceptance falls a
little. Exactness is untouched as long as the draft samples from q' and sends q' to the
verifier (any q is exact for the ratio test). At temperature 0, q is one-hot and C has no effect.
"""

from __future__ import annotations

import torch

from specd.core.sampling import SparseDist


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


def reshape_sorted(probs: torch.Tensor, top_f: int, c: float) -> torch.Tensor:
    """`reshape` for a batch of distributions whose columns are sorted by falling probability.

    probs: [R, N], each row summing to 1 (zeros allowed at the end) -> q' [R, N]. A row whose
    reshaped mass would vanish is returned unchanged, as `reshape` does.
    """
    assert 0.0 <= c <= 1.0, c
    if c == 1.0 or top_f <= 0:
        return probs
    weighted = probs.clone()
    weighted[:, :top_f] *= c  # [R, N]
    total = weighted.sum(-1, keepdim=True)  # [R, 1]
    return torch.where(total > 0, weighted / total.clamp(min=torch.finfo(probs.dtype).tiny), probs)
