"""Saguaro sampling (specd/core/saguaro.py) and its exactness through the verifier.

The statistical tests run 100k independent rounds in one batched verifier call, with the
draft sampling from the Saguaro-reshaped q' and the verifier given that same q'. Each
chi-square test is at alpha = 1e-3 (fails with probability 1e-3 for a random seed, for a
correct implementation); the seeds are fixed, so the suite is deterministic.
"""

from __future__ import annotations

import pytest
import scipy.stats
import torch

from specd.core.logits import logits_to_probs, sample_from_probs, sparse_to_dense
from specd.core.sampling import SamplingSettings, SparseDist
from specd.core.verify import rejection_sample
from tests.distributions import reshape, truncate_to_top

ALPHA = 1e-3
ROUNDS = 100_000


def test_reshape_down_weights_the_top_f():
    dist = SparseDist(token_ids=[7, 3, 5, 1], probs=[0.4, 0.3, 0.2, 0.1])
    out = reshape(dist, top_f=2, c=0.5)
    assert out.token_ids == [7, 3, 5, 1]
    total = 0.2 + 0.15 + 0.2 + 0.1
    assert out.probs == pytest.approx([0.2 / total, 0.15 / total, 0.2 / total, 0.1 / total])


def test_reshape_identity_cases():
    dist = SparseDist(token_ids=[2, 4], probs=[0.75, 0.25])
    assert reshape(dist, top_f=1, c=1.0) is dist
    assert reshape(dist, top_f=0, c=0.2) is dist
    # c = 0 with the whole support in the top F would leave no mass: unchanged.
    assert reshape(dist, top_f=2, c=0.0) is dist
    assert reshape(SparseDist([9], [1.0]), top_f=3, c=0.0).probs == [1.0]
    # c = 0 with mass outside the top F: only that mass remains.
    assert reshape(dist, top_f=1, c=0.0).probs == [0.0, 1.0]


def _chisquare_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Counts [V] against probs [V], pooling cells with expected counts below 5."""
    probs = probs.double()
    assert observed[probs == 0].sum() == 0, "a token of zero target probability was emitted"
    expected = probs * float(observed.sum())
    big = expected >= 5
    obs = observed[big].double().tolist()
    exp = expected[big].tolist()
    small = (~big) & (probs > 0)
    if small.any():
        obs.append(float(observed[small].sum()))
        exp.append(float(expected[small].sum()))
    scale = sum(obs) / sum(exp)
    return float(scipy.stats.chisquare(obs, [e * scale for e in exp]).pvalue)


def _saguaro_rounds(target_row: torch.Tensor, draft_row: torch.Tensor, top_f: int, c: float, max_support: int, seed: int):
    """ROUNDS one-token rounds: d ~ q' (Saguaro-reshaped, top-N truncated q), verified against p with q'."""
    vocab = target_row.shape[0]
    q_prime = reshape(truncate_to_top(draft_row, max_support), top_f, c)
    draft_dense = sparse_to_dense([q_prime], vocab)[0]  # [V]
    generator = torch.Generator().manual_seed(seed)
    draft_u = torch.rand(ROUNDS, dtype=torch.float64, generator=generator)
    draft_tokens = sample_from_probs(draft_dense.expand(ROUNDS, vocab), draft_u).unsqueeze(-1)  # [R, 1]
    accept_u = torch.rand(ROUNDS, 1, dtype=torch.float64, generator=generator)
    sample_u = torch.rand(ROUNDS, 2, dtype=torch.float64, generator=generator)
    result = rejection_sample(
        target_row.expand(ROUNDS, 2, vocab), draft_dense.expand(ROUNDS, 1, vocab), draft_tokens, accept_u, sample_u
    )
    emitted = torch.where(result.accepted > 0, draft_tokens[:, 0], result.next_token)  # [R]
    return q_prime, draft_tokens, result, emitted


@pytest.mark.parametrize("top_p, c", [(1.0, 0.3), (1.0, 0.0), (0.8, 0.5)])
def test_saguaro_output_follows_the_target(top_p, c):
    vocab = 24
    generator = torch.Generator().manual_seed(11)
    target_logits = torch.randn(vocab, generator=generator) * 1.5
    draft_logits = target_logits + torch.randn(vocab, generator=generator) * 0.7
    settings = SamplingSettings(temperature=1.0, top_p=top_p)
    target_row = logits_to_probs(target_logits, settings)  # [V]
    draft_row = logits_to_probs(draft_logits, settings)  # [V]
    _, draft_tokens, result, emitted = _saguaro_rounds(target_row, draft_row, top_f=3, c=c, max_support=16, seed=5)
    assert _chisquare_pvalue(torch.bincount(emitted, minlength=vocab), target_row) > ALPHA


def test_saguaro_moves_recovered_tokens_onto_the_top_f():
    # The point of Saguaro: on a rejection, t* lands in the draft's top F more often.
    vocab = 24
    generator = torch.Generator().manual_seed(3)
    target_logits = torch.randn(vocab, generator=generator) * 1.5
    target_row = logits_to_probs(target_logits, SamplingSettings(temperature=1.0))
    # A draft that roughly agrees with the target, as a useful draft does.
    draft_row = logits_to_probs(target_logits + torch.randn(vocab, generator=generator), SamplingSettings(temperature=1.0))
    top = set(torch.topk(draft_row, 3).indices.tolist())

    def hit_rate(c: float) -> float:
        _, _, result, _ = _saguaro_rounds(target_row, draft_row, top_f=3, c=c, max_support=24, seed=9)
        rejected = result.accepted == 0
        return sum(int(t) in top for t in result.next_token[rejected].tolist()) / int(rejected.sum())

    assert hit_rate(0.2) > hit_rate(1.0) + 0.05


def test_saguaro_without_sending_q_prime_is_detected():
    # A verifier given the un-reshaped q while the draft sampled from q' is biased: the test sees it.
    vocab = 12
    generator = torch.Generator().manual_seed(1)
    target_row = logits_to_probs(torch.randn(vocab, generator=generator) * 1.5, SamplingSettings(temperature=1.0))
    draft_row = logits_to_probs(torch.randn(vocab, generator=generator) * 1.5, SamplingSettings(temperature=1.0))
    q_prime = sparse_to_dense([reshape(truncate_to_top(draft_row, vocab), 3, 0.1)], vocab)[0]
    gen = torch.Generator().manual_seed(2)
    draft_tokens = sample_from_probs(q_prime.expand(ROUNDS, vocab), torch.rand(ROUNDS, dtype=torch.float64, generator=gen)).unsqueeze(-1)
    result = rejection_sample(
        target_row.expand(ROUNDS, 2, vocab),
        draft_row.expand(ROUNDS, 1, vocab),  # the wrong q
        draft_tokens,
        torch.rand(ROUNDS, 1, dtype=torch.float64, generator=gen),
        torch.rand(ROUNDS, 2, dtype=torch.float64, generator=gen),
    )
    emitted = torch.where(result.accepted > 0, draft_tokens[:, 0], result.next_token)
    assert _chisquare_pvalue(torch.bincount(emitted, minlength=vocab), target_row) < ALPHA


def test_batched_reshape_equals_reshape():
    from specd.core.saguaro import reshape_sorted

    generator = torch.Generator().manual_seed(8)
    probs = torch.rand(5, 10, generator=generator).sort(-1, descending=True).values  # [R, N]
    probs[3, 4:] = 0.0  # a short support
    probs = probs / probs.sum(-1, keepdim=True)
    for top_f, c in ((2, 0.5), (3, 0.0), (4, 0.25), (0, 0.1)):
        batched = reshape_sorted(probs, top_f, c)
        for row in range(probs.shape[0]):
            want = reshape(SparseDist(list(range(10)), probs[row].tolist()), top_f, c).probs
            assert batched[row].tolist() == pytest.approx(want, abs=1e-6)
