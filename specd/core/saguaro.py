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


def reshape_sorted(probs: torch.Tensor, top_f: int, c: float) -> torch.Tensor:
    """q' for a batch of distributions whose columns are sorted by falling probability: the top
    `top_f` probabilities of each row multiplied by c, renormalised.

    probs: [R, N], each row summing to 1 (zeros allowed at the end) -> q' [R, N]. A row whose
    reshaped mass would vanish (c = 0 and all its mass in the top F) is returned unchanged.
    """
    assert 0.0 <= c <= 1.0, c
    if c == 1.0 or top_f <= 0:
        return probs
    weighted = probs.clone()
    weighted[:, :top_f] *= c  # [R, N]
    total = weighted.sum(-1, keepdim=True)  # [R, 1]
    return torch.where(total > 0, weighted / total.clamp(min=torch.finfo(probs.dtype).tiny), probs)
