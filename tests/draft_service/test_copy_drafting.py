"""Copy drafting (draft_service/copy_drafting.py, specd/core/context_match.py): the lookup, the mixed
q', the draft worker's Propose and tree build with it, and exactness end to end."""

from __future__ import annotations

import concurrent.futures
import random

import pytest
import scipy.stats
import torch

from draft_service.config import DraftConfig
from draft_service.copy_drafting import OFF, CopyDrafting
from draft_service.runner import DraftModelRunner
from draft_service.speculation import _guesses
from specd.core.config import ConfigError
from specd.core.context_match import ContextMatcher
from specd.core.sampling import SamplingSettings, SparseDist
from specd.engine.loading import load_causal_lm
from specd.engine.session_cache import SessionStore
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)
from tests.draft_service.test_speculation import _assert_branches_equal_proposals
from tests.e2e.test_ssd_distribution import _pit
from tests.runner_calls import draft_propose

# 5 17 42 recurs: after it came 99, 7, 3, 250, so a greedy copy draft of 4 is exactly those.
REPEATING = [5, 17, 42, 99, 7, 3, 250, 11, 8, 5, 17, 42]


def _reference_next(history: list[int], n: int) -> int | None:
    """The lookup by brute force: scan back for the latest earlier occurrence of the last n tokens."""
    for start in range(len(history) - n - 1, -1, -1):
        if history[start : start + n] == history[-n:]:
            return history[start + n]
    return None


def test_the_latest_earlier_occurrence_is_copied():
    assert ContextMatcher([1, 2, 3, 9, 1, 2, 3, 8, 1, 2], 2).next_token([3]) == 8  # the later of two matches
    assert ContextMatcher(REPEATING, 3).next_token() == 99
    assert ContextMatcher(REPEATING, 3).next_token([99, 7]) == 3  # the suffix reaches into the extra tokens
    assert ContextMatcher([1, 2, 3, 4], 2).next_token() is None
    assert ContextMatcher([1, 2, 3, 9, 1, 2, 3, 8, 1, 2], 2).match_end([3]) == 7  # where the copy (8) starts
    assert ContextMatcher([7, 7], 1).next_token() == 7
    assert ContextMatcher([7], 1).next_token() is None  # nothing before the suffix
    assert ContextMatcher([1, 2, 1, 2, 1], 3).next_token([2]) == 1  # overlapping, periodic
    with pytest.raises(ValueError):
        ContextMatcher([1, 2], 0)


def test_the_lookup_agrees_with_a_brute_force_scan():
    rng = random.Random(7)
    for _ in range(300):
        history = [rng.randrange(4) for _ in range(rng.randrange(1, 40))]
        n = rng.randrange(1, 5)
        split = rng.randrange(len(history) + 1)
        assert ContextMatcher(history[:split], n).next_token(history[split:]) == _reference_next(history, n), (history, n, split)


def _reference_longest(history: list[int], n: int, longest: int) -> int | None:
    """The longest-match lookup by brute force: the latest earlier occurrence of the last m tokens,
    for the largest m from `longest` down to n that occurs."""
    for m in range(longest, n - 1, -1):
        if m < len(history) and (token := _reference_next(history, m)) is not None:
            return token
    return None


def test_the_occurrence_matching_the_most_tokens_wins_over_a_later_one():
    history = [4, 1, 2, 3, 9, 5, 1, 2, 3, 8, 4, 1, 2]
    assert ContextMatcher(history, 2).next_token([3]) == 8  # the latest match of 2 tokens
    assert ContextMatcher(history, 2, longest=4).next_token([3]) == 9  # "4 1 2 3" matched earlier
    assert ContextMatcher(history, 2, longest=3).next_token([3]) == 8  # both match 3: the later
    assert ContextMatcher(history, 2, longest=4).match_end([3]) == 4
    assert ContextMatcher(history, 3, longest=1).longest == 3  # never below ngram


def test_the_longest_match_agrees_with_a_brute_force_scan():
    rng = random.Random(11)
    for _ in range(400):
        history = [rng.randrange(3) for _ in range(rng.randrange(1, 40))]
        n = rng.randrange(1, 4)
        longest = rng.randrange(n, 9)
        split = rng.randrange(len(history) + 1)
        found = ContextMatcher(history[:split], n, longest).next_token(history[split:])
        assert found == _reference_longest(history, n, longest), (history, n, longest, split)


def test_copy_drafting_looks_for_the_longest_match_it_is_given():
    history = [4, 1, 2, 3, 9, 5, 1, 2, 3, 8, 4, 1, 2, 3]
    assert CopyDrafting(2, 0.8).over(history).copy_after([]) == 8
    assert CopyDrafting(2, 0.8, max_ngram=4).over(history).copy_after([]) == 9
    assert DraftConfig().copy_drafting() == CopyDrafting(3, 0.8, 8)


def test_q_prime_mixes_the_copy_in():
    q = SparseDist(token_ids=[4, 9, 2], probs=[0.5, 0.3, 0.2])
    copy = CopyDrafting(3, 0.8)
    inside = copy.mix(q, 9, greedy=False)
    assert inside.token_ids == [4, 9, 2] and inside.probs == pytest.approx([0.1, 0.86, 0.04])
    outside = copy.mix(q, 30, greedy=False)  # a token q gives no mass to still gets the weight
    assert outside.token_ids == [4, 9, 2, 30] and outside.probs == pytest.approx([0.1, 0.06, 0.04, 0.8])
    assert sum(outside.probs) == pytest.approx(1.0)
    assert copy.mix(q, None, greedy=False) is q
    assert OFF.mix(q, 9, greedy=False) is q


def test_greedy_drafts_take_the_argmax_of_q_prime():
    argmax = SparseDist(token_ids=[4], probs=[1.0])
    assert CopyDrafting(3, 0.8).mix(argmax, 9, greedy=True) == SparseDist(token_ids=[9], probs=[1.0])
    assert CopyDrafting(3, 0.5).mix(argmax, 9, greedy=True).token_ids == [9]
    assert CopyDrafting(3, 0.4).mix(argmax, 9, greedy=True) is argmax


def test_settings_are_checked():
    with pytest.raises(ValueError):
        CopyDrafting(-1, 0.5)
    with pytest.raises(ValueError):
        CopyDrafting(3, 1.5)
    with pytest.raises(ValueError):
        CopyDrafting(3, 0.5, -1)
    assert not CopyDrafting(0, 0.8).enabled and not CopyDrafting(3, 0.0).enabled
    assert (DraftConfig.copy_ngram, DraftConfig.copy_weight) == (3, 0.8)
    with pytest.raises(ConfigError):
        DraftConfig(copy_weight=2.0).validate()
    with pytest.raises(ConfigError, match="--copy-max-ngram"):
        DraftConfig(copy_max_ngram=-1).validate()
    with pytest.raises(ConfigError):
        DraftConfig(copy_ngram=-1).validate()


def test_guesses_rank_the_copy_first():
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0, -1.0], [0.0, 5.0, 4.0, 3.0, -1.0]])  # [K+1 = 2, V = 5]
    # Position 0: the copy (4) ranks first though the model ranks it last; d_1 = 1 is left out.
    # Position 1 (the bonus): the copy is d_1 itself there, so only the model's ranking counts.
    roots = _guesses(logits, [1], [2, 2], [4, None])
    assert roots == [(0, 4), (0, 2), (1, 1), (1, 2)]
    assert _guesses(logits, [1], [2, 0], [1, None]) == [(0, 2), (0, 3)]  # a copy that is d_{j+1} is no guess


@pytest.fixture(scope="module")
def loaded_draft(tiny_pair):
    return load_causal_lm(tiny_pair[1], dtype="float32", device="cpu")


def _runner(loaded, copy: CopyDrafting) -> DraftModelRunner:
    return DraftModelRunner(loaded, SessionStore(max_sessions=64, idle_timeout_s=300.0), max_support=64, copy=copy)


def test_greedy_propose_copies_the_earlier_continuation(loaded_draft):
    copying = draft_propose(_runner(loaded_draft, CopyDrafting(3, 0.8)), "s", 0, REPEATING, 4, SamplingSettings(), 0)
    assert copying.draft_tokens == [99, 7, 3, 250]
    plain = draft_propose(_runner(loaded_draft, OFF), "s", 0, REPEATING, 4, SamplingSettings(), 0)
    assert plain.draft_tokens != copying.draft_tokens  # the tiny draft alone drafts something else


def test_sampled_propose_reports_the_mixed_q(loaded_draft):
    sampling = SamplingSettings(temperature=1.0, seed=3)
    copying = draft_propose(_runner(loaded_draft, CopyDrafting(3, 0.8)), "s", 0, REPEATING, 1, sampling, 0)
    plain = draft_propose(_runner(loaded_draft, OFF), "s", 0, REPEATING, 1, sampling, 0)
    q, mixed = plain.draft_dists[0], copying.draft_dists[0]
    expected = {t: 0.2 * p for t, p in zip(q.token_ids, q.probs)}
    expected[99] = expected.get(99, 0.0) + 0.8
    assert dict(zip(mixed.token_ids, mixed.probs)) == pytest.approx(expected)


@pytest.mark.parametrize("num_draft, num_tokens", [(0, 3), (4, 4)])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_branches_equal_proposals_with_copy_drafting(loaded_draft, num_draft, num_tokens, temperature):
    """A branch drafts after its own history (d_1..d_j, its guess, its tokens), as Propose would there.
    ngram 1 on the repeating history: nearly every step copies."""
    runner = _runner(loaded_draft, CopyDrafting(1, 0.6))
    _assert_branches_equal_proposals(runner, num_draft, num_tokens, temperature, REPEATING)


PROMPT = "def add(a, b):\n    return a + b\n\ndef add(a, b):\n"
COPYING = dict(copy_ngram=1, copy_weight=0.5, copy_max_ngram=4)  # copies at almost every step: q' is far from q
TEMPERATURE = 1.0  # the tiny target spreads its mass: a copy gets far more of q' than of p


@pytest.fixture(scope="module")
def copying_stack(tiny_pair):
    overrides = dict(ssd_budget=4, ssd_backup="jit", speculation_max_running=0, draft_wait_min_ms=CALL_TIMEOUT_S * 1000.0)
    with running_stack(*tiny_pair, draft_overrides=COPYING, coordinator_overrides=overrides) as stack:
        yield stack


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD], ids=["sd", "ssd"])
def test_greedy_output_is_the_targets(copying_stack, tiny_pair, mode):
    model, tokenizer = load_reference(tiny_pair[0])
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)
    assert copying_stack.draft.servicer.runner.copy == CopyDrafting(COPYING["copy_ngram"], COPYING["copy_weight"], COPYING["copy_max_ngram"])
    response = copying_stack.stub().Generate(request(ids, mode=mode, k=4, max_new_tokens=40), timeout=CALL_TIMEOUT_S)
    assert response.stats.mode == mode and not response.stats.fallback_reason
    assert_greedy_equal_or_near_tie(model, ids, list(response.token_ids), greedy_reference(model, ids, 40))


def test_sampled_output_follows_the_target(copying_stack, tiny_pair):
    """sd, sampled: every emitted token's randomized PIT under the target is uniform (see
    test_ssd_distribution.py). A pipeline check, and a coarse one on the tiny pair (a draft
    reporting q' at weight 0.2 while sampling at 0.5 gave p = 0.03 here); the exact check that
    the q reported is the q sampled from is the chain above: a tree branch's q is Propose's,
    and Propose's is the model's q mixed with the copy."""
    mode = pb.SPECULATION_MODE_SD
    model, tokenizer = load_reference(tiny_pair[0])
    ids = tokenizer.encode(PROMPT, add_special_tokens=True)

    def one(seed: int):
        return copying_stack.stub().Generate(
            request(ids, mode=mode, k=2, max_new_tokens=24, temperature=TEMPERATURE, seed=seed), timeout=CALL_TIMEOUT_S
        )

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        responses = list(pool.map(one, range(120)))
    assert all(r.stats.mode == mode and not r.stats.fallback_reason for r in responses)
    values = _pit(model, ids, [list(r.token_ids) for r in responses], SamplingSettings(temperature=TEMPERATURE))
    pvalue = float(scipy.stats.kstest(values, "uniform").pvalue)
    assert pvalue > 1e-3, f"p = {pvalue:.2e}: sampled tokens with copy drafting do not follow the target"
