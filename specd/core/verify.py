"""The verifier: a pure function of tensors that decides how much of a draft to keep.

Vocabulary (used the same way everywhere in specd):
- draft tokens d_1..d_K were sampled by the draft from draft_probs q_1..q_K;
- target_probs p_1..p_{K+1} are the target's processed next-token distributions
  at the positions of d_1..d_K and the one after d_K;
- d_i is *accepted* with probability min(1, p_i(d_i) / q_i(d_i)), in order, until the
  first rejection; k is the number accepted;
- on a rejection at position k+1 the *recovered* token is sampled from
  norm(max(0, p_{k+1} - q_{k+1}));
- after k = K acceptances the *bonus* token is sampled from p_{K+1}.
Each round emits d_1..d_k and then t*, the recovered or bonus token, so the emitted
tokens follow the target's distribution exactly, whatever q is, provided q is the
distribution the draft really sampled from.
"""

from __future__ import annotations

import dataclasses

import torch

from specd.core.logits import sample_from_probs


@dataclasses.dataclass(frozen=True)
class VerifyResult:
    accepted: torch.Tensor  # [B] int64: k in 0..K
    next_token: torch.Tensor  # [B] int64: t*, the recovered or bonus token
    is_bonus: torch.Tensor  # [B] bool: k == K


def _count_leading_true(mask: torch.Tensor) -> torch.Tensor:
    """[B, K] bool -> [B] int64: how many leading entries are True."""
    return mask.long().cumprod(-1).sum(-1)


def greedy_verify(target_argmax: torch.Tensor, draft_tokens: torch.Tensor) -> VerifyResult:
    """Temperature 0: keep the draft while it equals the target's argmax.

    target_argmax: [B, K+1] int64, draft_tokens: [B, K] int64.
    """
    num_draft = draft_tokens.shape[-1]
    accepted = _count_leading_true(target_argmax[:, :num_draft] == draft_tokens)  # [B]
    next_token = target_argmax.gather(-1, accepted.unsqueeze(-1)).squeeze(-1)  # [B]
    return VerifyResult(accepted, next_token, accepted == num_draft)


def greedy_match(target_ids: list[int], draft_tokens: list[int]) -> tuple[int, int]:
    """greedy_verify of one draft on the host: (k, t*) from the target's argmax ids [K+1]."""
    accepted = 0
    while accepted < len(draft_tokens) and target_ids[accepted] == draft_tokens[accepted]:
        accepted += 1
    return accepted, target_ids[accepted]


def rejection_sample(
    target_probs: torch.Tensor,
    draft_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    accept_uniforms: torch.Tensor,
    sample_uniforms: torch.Tensor,
) -> VerifyResult:
    """The ratio test over a batch of drafts.

    target_probs: [B, K+1, V], draft_probs: [B, K, V] (dense q, zero off its support),
    draft_tokens: [B, K] int64, accept_uniforms: [B, K] in [0, 1),
    sample_uniforms: [B, K+1] in [0, 1): entry k draws t* when k tokens were accepted.
    """
    batch, num_draft = draft_tokens.shape
    index = draft_tokens.unsqueeze(-1)  # [B, K, 1]
    target_at_draft = target_probs[:, :num_draft].gather(-1, index).squeeze(-1).double()  # [B, K]
    draft_at_draft = draft_probs.gather(-1, index).squeeze(-1).double()  # [B, K]
    # u < p/q written without the division: q > 0 for a token q sampled.
    accept = accept_uniforms.double() * draft_at_draft < target_at_draft  # [B, K]
    accepted = _count_leading_true(accept)  # [B]

    rows = torch.arange(batch, device=target_probs.device)
    target_next = target_probs[rows, accepted].double()  # [B, V]
    # Past the last draft position there is no q: the bonus token comes from p alone.
    padded_draft = torch.cat([draft_probs, draft_probs.new_zeros(batch, 1, draft_probs.shape[-1])], dim=1)  # [B, K+1, V]
    residual = (target_next - padded_draft[rows, accepted].double()).clamp_(min=0.0)  # [B, V]
    # A rejection implies p(x) < q(x) somewhere, so mass remains elsewhere; rounding
    # alone can empty it, and then p itself is the right fallback.
    empty = residual.sum(-1) <= 0  # [B]
    residual = torch.where(empty.unsqueeze(-1), target_next, residual)  # [B, V]
    uniforms = sample_uniforms[rows, accepted]  # [B]
    next_token = sample_from_probs(residual, uniforms)  # [B]
    return VerifyResult(accepted, next_token, accepted == num_draft)
