"""The pure verifier (specd/core/verify.py): greedy tables, determinism, and the ratio test's exactness.

The statistical tests run one batched call of B = 100k independent rounds. Every round uses the
same target_probs row at every position and the same draft_probs row at every draft position
("history-free"), so the target's marginal at each output position is that one row p.
Each chi-square test is at alpha = 1e-3: with a correct verifier a given test fails with
probability 1e-3 for a random seed; the seed is fixed, so the suite is deterministic.
"""

from __future__ import annotations

import pytest
import scipy.stats
import torch

from specd.core.logits import logits_to_probs, sample_from_probs, sparse_to_dense
from specd.core.sampling import SamplingSettings
from specd.core.verify import greedy_match, greedy_verify, rejection_sample
from tests.distributions import truncate_to_top

ALPHA = 1e-3
ROUNDS = 100_000


def _t(rows):
    return torch.tensor(rows, dtype=torch.long)


# ---------------------------------------------------------------- greedy


@pytest.mark.parametrize(
    "target_argmax, draft, accepted, next_token",
    [
        ([5, 6, 7, 8], [5, 6, 7], 3, 8),  # all accepted: bonus after d_K
        ([5, 6, 7, 8], [1, 6, 7], 0, 5),  # first rejected: t* = the target's argmax there
        ([5, 6, 7, 8], [5, 9, 7], 1, 6),  # middle rejected; later matches do not count
        ([5, 6, 7, 8], [5, 6, 1], 2, 7),  # last rejected
        ([3, 4], [3], 1, 4),  # K = 1, accepted
        ([3, 4], [2], 0, 3),  # K = 1, rejected
        ([9], [], 0, 9),  # K = 0: a plain decode step, the argmax is a bonus token
    ],
)
def test_greedy_table(target_argmax, draft, accepted, next_token):
    result = greedy_verify(_t([target_argmax]), _t([draft]).reshape(1, len(draft)))
    assert result.accepted.tolist() == [accepted]
    assert result.next_token.tolist() == [next_token]
    assert result.is_bonus.tolist() == [accepted == len(draft)]
    assert greedy_match(target_argmax, draft) == (accepted, next_token)  # the host's match, the same


def test_greedy_batch_rows_are_independent():
    result = greedy_verify(_t([[5, 6, 7], [5, 6, 7], [1, 2, 3]]), _t([[5, 6], [5, 0], [0, 2]]))
    assert result.accepted.tolist() == [2, 1, 0]
    assert result.next_token.tolist() == [7, 6, 1]
    assert result.is_bonus.tolist() == [True, False, False]


# ---------------------------------------------------------------- determinism


def _random_case(batch: int, num_draft: int, vocab: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    target_probs = torch.rand(batch, num_draft + 1, vocab, generator=gen).softmax(-1)
    draft_probs = torch.rand(batch, num_draft, vocab, generator=gen).softmax(-1)
    draft_tokens = torch.randint(vocab, (batch, num_draft), generator=gen)
    accept_u = torch.rand(batch, num_draft, generator=gen, dtype=torch.float64)
    sample_u = torch.rand(batch, num_draft + 1, generator=gen, dtype=torch.float64)
    return target_probs, draft_probs, draft_tokens, accept_u, sample_u


@pytest.mark.parametrize("num_draft", [0, 1, 4])
def test_rejection_sample_is_a_function_of_its_uniforms(num_draft):
    args = _random_case(64, num_draft, 10, seed=1)
    first = rejection_sample(*args)
    second = rejection_sample(*[a.clone() for a in args])
    assert torch.equal(first.accepted, second.accepted)
    assert torch.equal(first.next_token, second.next_token)
    assert torch.equal(first.is_bonus, second.is_bonus)
    assert ((first.accepted >= 0) & (first.accepted <= num_draft)).all()
    # Other uniforms change the outcome somewhere in the batch.
    other = rejection_sample(*args[:3], torch.rand_like(args[3]), torch.rand_like(args[4]))
    assert not torch.equal(torch.stack([first.accepted, first.next_token]), torch.stack([other.accepted, other.next_token]))


def test_rejection_sample_k0_samples_the_target():
    target_probs = torch.tensor([[[0.0, 0.25, 0.0, 0.75]]])  # [1, 1, V]
    draft_probs = torch.zeros(1, 0, 4)
    draft_tokens = torch.zeros(1, 0, dtype=torch.long)
    for u, expected in [(0.0, 1), (0.2, 1), (0.25, 3), (0.99, 3)]:
        result = rejection_sample(target_probs, draft_probs, draft_tokens, torch.zeros(1, 0), torch.tensor([[u]]))
        assert result.accepted.tolist() == [0]
        assert result.is_bonus.tolist() == [True]
        assert result.next_token.tolist() == [expected]


def test_rejection_sample_recovered_token_is_off_the_draft_excess():
    # p = [.5, .5, 0], q = [1, 0, 0]: d = 0 is accepted w.p. 1/2; when rejected t* must be 1.
    target_probs = torch.tensor([[[0.5, 0.5, 0.0], [0.0, 0.0, 1.0]]])
    draft_probs = torch.tensor([[[1.0, 0.0, 0.0]]])
    draft = torch.tensor([[0]])
    rejected = rejection_sample(target_probs, draft_probs, draft, torch.tensor([[0.7]]), torch.tensor([[0.0, 0.0]]))
    assert rejected.accepted.tolist() == [0] and rejected.next_token.tolist() == [1]
    assert rejected.is_bonus.tolist() == [False]
    accepted = rejection_sample(target_probs, draft_probs, draft, torch.tensor([[0.3]]), torch.tensor([[0.0, 0.9]]))
    assert accepted.accepted.tolist() == [1] and accepted.next_token.tolist() == [2]
    assert accepted.is_bonus.tolist() == [True]


# ---------------------------------------------------------------- exactness (statistical)


def _chisquare_pvalue(observed: torch.Tensor, probs: torch.Tensor) -> float:
    """Goodness of fit of counts [V] to probs [V]; zero-mass tokens must never occur.

    Tokens with an expected count below 5 are pooled into one cell, as the test requires.
    """
    probs = probs.double()
    assert observed[probs == 0].sum() == 0, "a token of zero target probability was emitted"
    total = int(observed.sum())
    expected = probs * total
    big = expected >= 5
    obs_cells = observed[big].double().tolist()
    exp_cells = expected[big].tolist()
    small = (~big) & (probs > 0)
    if small.any():
        obs_cells.append(float(observed[small].sum()))
        exp_cells.append(float(expected[small].sum()))
    scale = sum(obs_cells) / sum(exp_cells)  # exact up to float rounding
    exp_cells = [e * scale for e in exp_cells]
    return float(scipy.stats.chisquare(obs_cells, exp_cells).pvalue)


def _run_rounds(target_row: torch.Tensor, draft_row: torch.Tensor, num_draft: int, seed: int):
    """ROUNDS rounds against one target row p [V] and one draft row q [V]; drafts sampled from q."""
    torch.manual_seed(seed)
    vocab = target_row.shape[0]
    target_probs = target_row.expand(ROUNDS, num_draft + 1, vocab)
    draft_probs = draft_row.expand(ROUNDS, num_draft, vocab)
    draft_u = torch.rand(ROUNDS * num_draft, dtype=torch.float64)
    draft_tokens = sample_from_probs(draft_row.expand(ROUNDS * num_draft, vocab), draft_u).view(ROUNDS, num_draft)
    assert (draft_row[draft_tokens] > 0).all()
    accept_u = torch.rand(ROUNDS, num_draft, dtype=torch.float64)
    sample_u = torch.rand(ROUNDS, num_draft + 1, dtype=torch.float64)
    result = rejection_sample(target_probs, draft_probs, draft_tokens, accept_u, sample_u)
    return draft_tokens, result


def _emitted_at(position: int, draft_tokens: torch.Tensor, result) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows whose round emits an output token at `position`, and that token.

    The round emits d_1..d_k then t*, so it reaches `position` iff k >= position; then the token is
    d_{position+1} if k > position else t*. Whether k >= position depends only on draws at earlier
    positions, which are independent of the draws at `position`, so the token there, conditioned on
    being emitted, must still follow p.
    """
    reached = result.accepted >= position
    tokens = result.next_token[reached].clone()
    if draft_tokens.shape[1] > position:
        from_draft = result.accepted[reached] > position
        tokens[from_draft] = draft_tokens[reached][from_draft, position]
    return reached, tokens


def _settings_probs(logits: torch.Tensor, **kwargs) -> torch.Tensor:
    return logits_to_probs(logits, SamplingSettings(**kwargs))


def _cases():
    gen = torch.Generator().manual_seed(1234)
    vocab = 12
    target_logits = torch.randn(vocab, generator=gen) * 1.5
    draft_logits = target_logits + torch.randn(vocab, generator=gen) * 1.2
    t1 = _settings_probs(target_logits, temperature=1.0)
    q1 = _settings_probs(draft_logits, temperature=1.0)
    cases = {
        "temperature-1": (t1, q1, 3),
        "temperature-0.7-top-k-5": (
            _settings_probs(target_logits, temperature=0.7, top_k=5),
            _settings_probs(draft_logits, temperature=0.7, top_k=5),
            4,
        ),
        "top-p-0.8": (
            _settings_probs(target_logits, temperature=1.0, top_p=0.8),
            _settings_probs(draft_logits, temperature=1.0, top_p=0.8),
            2,
        ),
        "draft-equals-target": (t1, t1.clone(), 3),
    }
    # Disjoint supports: the draft has no mass where the target has all of it.
    order = target_logits.argsort(descending=True)
    disjoint_target = torch.zeros(vocab)
    disjoint_target[order[:6]] = t1[order[:6]] / t1[order[:6]].sum()
    disjoint_draft = torch.zeros(vocab)
    disjoint_draft[order[6:]] = q1[order[6:]] / q1[order[6:]].sum()
    cases["disjoint-supports"] = (disjoint_target, disjoint_draft, 3)
    # A draft truncated to its top-4 tokens and renormalised, as the draft worker sends it.
    truncated = sparse_to_dense([truncate_to_top(q1, 4)], vocab)[0]
    cases["draft-truncated-top-4"] = (t1, truncated, 3)
    return cases


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_emitted_tokens_follow_the_target(name):
    target_row, draft_row, num_draft = CASES[name]
    draft_tokens, result = _run_rounds(target_row, draft_row, num_draft, seed=list(CASES).index(name))
    vocab = target_row.shape[0]

    # Acceptance of d_1 has probability exactly sum_x min(p(x), q(x)) (1e-6: float32 rows).
    expected_rate = float(torch.minimum(target_row, draft_row).double().sum())
    rate = float((result.accepted >= 1).double().mean())
    stderr = (max(expected_rate * (1 - expected_rate), 0.0) / ROUNDS) ** 0.5
    assert abs(rate - expected_rate) <= 5 * stderr + 1e-6, (rate, expected_rate)
    if name == "draft-equals-target":
        assert (result.accepted == num_draft).all() and result.is_bonus.all()
    if name == "disjoint-supports":
        assert (result.accepted == 0).all() and not result.is_bonus.any()

    for position in (0, 1):
        reached, tokens = _emitted_at(position, draft_tokens, result)
        if int(reached.sum()) < 1000:
            assert position > 0  # position 0 is always emitted
            continue
        counts = torch.bincount(tokens, minlength=vocab)
        pvalue = _chisquare_pvalue(counts, target_row)
        assert pvalue > ALPHA, f"{name}: position {position}: p-value {pvalue:.2e}, counts {counts.tolist()}"


def test_emitted_tokens_detect_a_wrong_verifier():
    """The chi-square check has power: sampling t* from p instead of norm(max(0, p - q)) is caught."""
    target_row, draft_row, num_draft = CASES["temperature-1"]
    draft_tokens, result = _run_rounds(target_row, draft_row, num_draft, seed=7)
    wrong = result.next_token.clone()
    rejected = result.accepted == 0
    wrong[rejected] = sample_from_probs(
        target_row.expand(int(rejected.sum()), -1), torch.rand(int(rejected.sum()), dtype=torch.float64)
    )
    first = torch.where(result.accepted >= 1, draft_tokens[:, 0], wrong)
    assert _chisquare_pvalue(torch.bincount(first, minlength=target_row.shape[0]), target_row) < ALPHA
