"""specd/core/sampling.py, specd/core/logits.py: logits processing as transformers does it, keyed uniforms, sampling, truncation."""

from __future__ import annotations

import pytest
import torch
from transformers.generation.logits_process import (
    RepetitionPenaltyLogitsProcessor,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

from specd.core.logits import (
    keyed_uniforms,
    logits_to_probs,
    penalize_repeats,
    sample_from_probs,
    sparse_to_dense,
)
from specd.core.sampling import Purpose, SamplingSettings, SparseDist, keyed_uniform, sample_sparse, sampling_problem
from tests.distributions import truncate_to_top


def _transformers_probs(logits: torch.Tensor, settings: SamplingSettings) -> torch.Tensor:
    """What `generate(do_sample=True)` samples from: temperature, top-k, top-p warpers, then softmax."""
    input_ids = torch.zeros(logits.shape[0], 1, dtype=torch.long)
    scores = logits.clone()
    warpers = [TemperatureLogitsWarper(settings.temperature)]
    if settings.top_k:
        warpers.append(TopKLogitsWarper(settings.top_k))
    if settings.top_p < 1.0:
        warpers.append(TopPLogitsWarper(settings.top_p))
    for warper in warpers:
        scores = warper(input_ids, scores)
    return scores.softmax(-1)


@pytest.mark.parametrize(
    "settings",
    [
        SamplingSettings(temperature=1.0),
        SamplingSettings(temperature=0.7),
        SamplingSettings(temperature=1.3, top_k=10),
        SamplingSettings(temperature=1.0, top_k=1),
        SamplingSettings(temperature=0.8, top_p=0.9),
        SamplingSettings(temperature=1.0, top_p=0.05),
        SamplingSettings(temperature=0.6, top_k=20, top_p=0.7),
        SamplingSettings(temperature=1.0, top_k=500),  # top_k above the vocabulary: off
    ],
    ids=str,
)
def test_logits_to_probs_matches_transformers_warpers(settings):
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(16, 300, generator=gen) * 3
    ours = logits_to_probs(logits, settings)
    theirs = _transformers_probs(logits, settings)
    assert ours.shape == theirs.shape and ours.dtype == torch.float32
    assert torch.equal(ours == 0, theirs == 0), "the kept support differs"
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(ours.sum(-1), torch.ones(16), rtol=0, atol=1e-5)


def test_logits_to_probs_keeps_leading_dims():
    logits = torch.randn(2, 3, 50)
    probs = logits_to_probs(logits, SamplingSettings(temperature=0.9, top_k=5))
    assert probs.shape == (2, 3, 50)
    assert ((probs > 0).sum(-1) == 5).all()


def test_logits_to_probs_greedy_is_one_hot_argmax():
    logits = torch.tensor([[0.1, 2.0, 2.0, -1.0], [5.0, 0.0, 0.0, 0.0]])
    probs = logits_to_probs(logits, SamplingSettings(temperature=0.0))
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]  # first maximum, as argmax


def test_keyed_uniform_is_deterministic_and_in_range():
    values = [keyed_uniform(seed, pos, purpose) for seed in (0, 1, 2**63 - 1, 2**64 - 1) for pos in range(50) for purpose in Purpose]
    assert values == [keyed_uniform(seed, pos, purpose) for seed in (0, 1, 2**63 - 1, 2**64 - 1) for pos in range(50) for purpose in Purpose]
    assert all(0.0 <= v < 1.0 for v in values)
    assert len(set(values)) == len(values)  # no collisions across seeds, positions and purposes


def test_keyed_uniform_differs_across_purposes_positions_and_seeds():
    base = keyed_uniform(42, 10, Purpose.ACCEPT)
    assert base != keyed_uniform(42, 10, Purpose.SAMPLE)
    assert base != keyed_uniform(42, 10, Purpose.DRAFT)
    assert base != keyed_uniform(42, 11, Purpose.ACCEPT)
    assert base != keyed_uniform(43, 10, Purpose.ACCEPT)


def test_keyed_uniforms_batch_equals_scalar():
    batch = keyed_uniforms(7, 100, 5, Purpose.SAMPLE)
    assert batch.dtype == torch.float64 and batch.shape == (5,)
    assert batch.tolist() == [keyed_uniform(7, 100 + i, Purpose.SAMPLE) for i in range(5)]
    assert keyed_uniforms(7, 3, 0, Purpose.SAMPLE).shape == (0,)


def test_keyed_uniforms_look_uniform():
    values = keyed_uniforms(123, 0, 20_000, Purpose.DRAFT)
    assert abs(float(values.mean()) - 0.5) < 0.01
    counts = torch.histc(values.float(), bins=10, min=0.0, max=1.0)
    assert counts.min() > 1800 and counts.max() < 2200


_LARGEST_UNIFORM = 1.0 - 2.0**-53  # the largest value keyed_uniform returns


@pytest.mark.parametrize("u", [0.0, 1e-300, 0.25, 0.5, 0.999999, _LARGEST_UNIFORM])
def test_sample_from_probs_never_picks_zero_mass(u):
    gen = torch.Generator().manual_seed(3)
    probs = torch.rand(200, 9, generator=gen)
    probs[torch.rand(200, 9, generator=gen) < 0.5] = 0.0
    probs[:, 0] = 0.0  # leading and trailing zeros: the edges of the inverse CDF
    probs[:, -1] = 0.0
    probs[torch.arange(200), torch.randint(1, 8, (200,), generator=gen)] = 0.3  # at least one positive
    tokens = sample_from_probs(probs, torch.full((200,), u, dtype=torch.float64))
    assert (probs[torch.arange(200), tokens] > 0).all()


def test_sample_from_probs_inverse_cdf_boundaries():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.5, 0.0]])
    pick = lambda u: int(sample_from_probs(probs, torch.tensor([u], dtype=torch.float64))[0])  # noqa: E731
    assert pick(0.0) == 1
    assert pick(0.4999) == 1
    assert pick(0.5) == 3  # the cdf at a boundary belongs to the next positive token
    assert pick(_LARGEST_UNIFORM) == 3
    # Unnormalised probabilities scale the uniform.
    assert int(sample_from_probs(probs * 4, torch.tensor([0.6], dtype=torch.float64))[0]) == 3


def test_sample_from_probs_frequencies():
    probs = torch.tensor([0.1, 0.0, 0.6, 0.3])
    torch.manual_seed(0)
    tokens = sample_from_probs(probs.expand(100_000, 4), torch.rand(100_000, dtype=torch.float64))
    freq = torch.bincount(tokens, minlength=4).double() / 100_000
    assert freq[1] == 0
    torch.testing.assert_close(freq, probs.double(), rtol=0, atol=0.006)


def test_truncate_to_top_keeps_n_and_renormalises():
    probs = torch.tensor([0.05, 0.4, 0.0, 0.25, 0.2, 0.1])
    dist = truncate_to_top(probs, 3)
    assert dist.token_ids == [1, 3, 4]
    assert sum(dist.probs) == pytest.approx(1.0, abs=1e-6)
    assert dist.probs == pytest.approx([0.4 / 0.85, 0.25 / 0.85, 0.2 / 0.85], rel=1e-6)
    # N beyond the support keeps only the positive-mass tokens.
    wide = truncate_to_top(probs, 100)
    assert sorted(wide.token_ids) == [0, 1, 3, 4, 5]
    assert sum(wide.probs) == pytest.approx(1.0, abs=1e-6)
    dense = sparse_to_dense([dist, wide], 6)
    assert dense.shape == (2, 6)
    torch.testing.assert_close(dense[1], probs / probs.sum())
    assert dense[0, [0, 2, 5]].tolist() == [0.0, 0.0, 0.0]


def test_sample_sparse_stays_in_support():
    dist = SparseDist(token_ids=[7, 3, 9], probs=[0.5, 0.0, 0.5])
    assert sample_sparse(dist, 0.0) == 7
    assert sample_sparse(dist, 0.5) == 9
    assert sample_sparse(dist, _LARGEST_UNIFORM) == 9
    assert all(sample_sparse(dist, u / 100) in (7, 9) for u in range(100))


@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_penalize_repeats_equals_transformers_row_by_row(penalty):
    """Row r sees the history and then its own tokens, as transformers' processor sees input_ids
    [history + row_tokens[r]]: bit for bit, positive and negative logits alike."""
    generator = torch.Generator().manual_seed(5)
    vocab = 50
    logits = torch.randn(4, vocab, generator=generator) * 3  # [R, V]
    history = [3, 7, 7, 12, 49]
    row_tokens = [[], [20], [20, 3], [21, 0, 21]]
    got = penalize_repeats(logits, history, row_tokens, penalty)
    for row, tokens in enumerate(row_tokens):
        input_ids = torch.tensor([history + tokens])  # [1, L]
        want = RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits[row : row + 1].clone())[0]
        assert torch.equal(got[row], want), row
    untouched = torch.ones(vocab, dtype=torch.bool)
    untouched[history + [20, 21, 0]] = False
    assert torch.equal(got[:, untouched], logits[:, untouched])
    assert not torch.equal(got[0, history], logits[0, history])


@pytest.mark.parametrize("penalty", [0.0, -1.0, float("nan"), float("inf")])
def test_sampling_problem_names_a_bad_repetition_penalty(penalty):
    assert "repetition_penalty" in sampling_problem(SamplingSettings(repetition_penalty=penalty))


def test_a_penalty_of_one_is_off():
    assert not SamplingSettings().penalizes and SamplingSettings(repetition_penalty=1.2).penalizes
    assert sampling_problem(SamplingSettings(repetition_penalty=0.5)) is None
