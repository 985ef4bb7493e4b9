"""A batch's verifies decided together (target_service/verify_decision.py): the plain greedy ones
from one read-back of their argmax ids, the others (penalised, asking logprobs, sampled) by their
own ratio test; every outcome is the one its verify gets decided alone."""

from __future__ import annotations

import torch

import target_service.verify_decision as verify_decision
from specd.core.sampling import SamplingSettings, SparseDist
from target_service.calls import VerifyCall
from target_service.verify_decision import Verified, decide, decide_all

VOCAB = 50
GREEDY = SamplingSettings()


def _draft(logits: torch.Tensor, matching: int) -> list[int]:
    """A draft of K = rows - 1 tokens whose first `matching` are the logits' argmax, then not."""
    best = logits.argmax(-1).tolist()
    return [best[j] if j < matching else (best[j] + 1) % VOCAB for j in range(logits.shape[0] - 1)]


def _verified(logits: torch.Tensor, matching: int, sampling: SamplingSettings = GREEDY, logprobs: bool = False) -> Verified:
    draft = _draft(logits, matching)
    dists = [] if sampling.greedy else [SparseDist([token, (token + 3) % VOCAB], [0.6, 0.4]) for token in draft]
    call = VerifyCall("s", 0, [1, 2, 3], draft, dists, sampling, logprobs)
    return Verified(call, logits, [4, 9, 4, 7], 10, 10 + len(draft))


def test_a_batch_of_verifies_is_decided_as_each_alone_with_one_read_back_for_the_plain_greedy(monkeypatch):
    generator = torch.Generator().manual_seed(0)
    logits = [torch.randn(rows, VOCAB, generator=generator) for rows in (4, 1, 3, 4, 3, 4)]
    verified = [
        _verified(logits[0], 2),  # plain greedy: rejected at d_3
        _verified(logits[1], 0),  # plain greedy, K = 0: a decode step
        _verified(logits[2], 2),  # plain greedy: every draft token kept, a bonus token
        _verified(logits[3], 3, SamplingSettings(repetition_penalty=1.3)),  # penalised
        _verified(logits[4], 1, logprobs=True),  # asks logprobs
        _verified(logits[5], 3, SamplingSettings(temperature=0.8, seed=5)),  # sampled
    ]
    read_backs = []
    monkeypatch.setattr(verify_decision, "to_host", lambda *t, read=verify_decision.to_host: read_backs.append(len(t)) or read(*t))
    together = decide_all(verified, 1.5)
    assert len(read_backs) == 1 + 3  # the plain greedy verifies' ids at once, then one per other verify
    assert together == [decide(v, 1.5) for v in verified]
    assert [(o.accepted, o.is_bonus) for o in together[:3]] == [(2, False), (0, True), (2, True)]
    assert together[4].logprobs and all(o.cached_tokens == v.cached_tokens for o, v in zip(together, verified))
