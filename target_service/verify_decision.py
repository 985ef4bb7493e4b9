"""A verify's decision from its logits: the ratio test (or the greedy match) on the logits' device,
then only its few values read back.

A batch's plain greedy verifies (no repetition penalty, no logprobs asked) are decided together:
each takes the argmax of its rows on the device, and one read-back brings every verify's ids to
the host, where the match is a few integer comparisons. On a GPU every read-back waits for the
device and every tensor operation is a launch, so a batch of verifies costs one wait, not one per
verify. The others (sampled, penalised, or asking logprobs) take their own ratio test.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import NamedTuple

import torch

from specd.core.logits import keyed_uniforms, logits_to_probs, penalize_repeats, sparse_to_dense
from specd.core.sampling import Purpose
from specd.core.verify import VerifyResult, greedy_match, greedy_verify, rejection_sample
from specd.engine.host_copy import to_host
from target_service.calls import VerifyCall


@dataclasses.dataclass(frozen=True)
class VerifyOutcome:
    accepted: int  # k
    next_token: int  # t*
    is_bonus: bool
    logprobs: list[float]  # of d_1..d_k, t* under the target's raw distribution, when asked
    forward_ms: float
    cached_tokens: int


class Verified(NamedTuple):
    """One verify after its forward: what its decision reads."""

    call: VerifyCall
    logits: torch.Tensor  # [K+1, V], on the model's device
    history: list[int]  # the committed tokens before d_1, for a repetition penalty ([] without one)
    first_position: int  # the absolute position of d_1
    cached_tokens: int  # what the session's cache holds after the forward


def decide_all(verified: list[Verified], forward_ms: float) -> list[VerifyOutcome]:
    """Each verify's outcome, the plain greedy ones from one read-back of their argmax ids."""
    plain = [i for i, v in enumerate(verified) if _plain_greedy(v.call)]
    outcomes: dict[int, VerifyOutcome] = {}
    if plain:
        ids = to_host(torch.cat([verified[i].logits.argmax(-1) for i in plain]))[0].tolist()  # [sum of K+1]
        ends = itertools.accumulate(verified[i].call.num_draft + 1 for i in plain)
        for i, end in zip(plain, ends):
            call = verified[i].call
            accepted, next_token = greedy_match(ids[end - call.num_draft - 1 : end], call.draft_tokens)
            outcomes[i] = VerifyOutcome(accepted, next_token, accepted == call.num_draft, [], forward_ms, verified[i].cached_tokens)
    return [outcomes[i] if i in outcomes else decide(v, forward_ms) for i, v in enumerate(verified)]


def _plain_greedy(call: VerifyCall) -> bool:
    return call.sampling.greedy and not call.sampling.penalizes and not call.return_logprobs


def decide(verified: Verified, forward_ms: float) -> VerifyOutcome:
    """The ratio test (or greedy match) over one verify's logits, then its few values read back."""
    call, logits = verified.call, verified.logits
    result = verify_logits(call, logits, verified.history, verified.first_position)
    wanted = [result.accepted, result.next_token, result.is_bonus]  # [1] each
    if call.return_logprobs:
        wanted.append(emitted_logprobs(call.draft_tokens, logits, result))
    read = to_host(*wanted)  # one wait for all of them
    accepted = int(read[0][0])
    return VerifyOutcome(
        accepted=accepted,
        next_token=int(read[1][0]),
        is_bonus=bool(read[2][0]),
        logprobs=read[3][: accepted + 1].tolist() if call.return_logprobs else [],
        forward_ms=forward_ms,
        cached_tokens=verified.cached_tokens,
    )


def verify_logits(call: VerifyCall, logits: torch.Tensor, history: list[int], first_position: int) -> VerifyResult:
    """The ratio test (greedy: the match) of `call`'s draft against the target's logits [K+1, V]
    after `history`, d_1 at absolute position `first_position`: tensors on the logits' device,
    nothing read back."""
    num_draft, device = call.num_draft, logits.device
    draft = torch.tensor([call.draft_tokens], dtype=torch.long, device=device)  # [1, K]
    if call.sampling.penalizes:
        # Row j follows every committed token and d_1..d_j.
        row_tokens = [call.draft_tokens[:j] for j in range(num_draft + 1)]
        logits = penalize_repeats(logits, history, row_tokens, call.sampling.repetition_penalty)  # [K+1, V]
    if call.sampling.greedy:
        return greedy_verify(logits.argmax(-1).unsqueeze(0), draft)
    target_probs = logits_to_probs(logits, call.sampling).unsqueeze(0)  # [1, K+1, V]
    draft_probs = sparse_to_dense(call.dists, logits.shape[-1], device).unsqueeze(0)  # [1, K, V]
    seed = call.sampling.seed
    accept_u = keyed_uniforms(seed, first_position, num_draft, Purpose.ACCEPT, device)  # [K]
    sample_u = keyed_uniforms(seed, first_position, num_draft + 1, Purpose.SAMPLE, device)  # [K+1]
    return rejection_sample(target_probs, draft_probs, draft, accept_u.unsqueeze(0), sample_u.unsqueeze(0))


def emitted_logprobs(draft_tokens: list[int], logits: torch.Tensor, result: VerifyResult) -> torch.Tensor:
    """The model's own log-probability (before any penalty) of the token each row of a verify's
    logits [K+1, V] emits if the verify accepts up to it: row j < k its d_{j+1}, row k the next
    token; [K+1], on the logits' device (rows past k mean nothing)."""
    rows, device = logits.shape[0], logits.device
    candidates = torch.tensor(draft_tokens + [0], dtype=torch.long, device=device)  # [K+1]
    row = torch.arange(rows, device=device)  # [K+1]
    emitted = torch.where(row == result.accepted[0], result.next_token[0], candidates)  # [K+1]
    return logits.log_softmax(-1).gather(-1, emitted.unsqueeze(-1)).squeeze(-1)  # [K+1]
