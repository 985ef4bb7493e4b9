"""SSD's zero-cost backup (coordinator/backup.py): prompt lookup, and the exactness of its one-hot q.

The chi-square test runs 100k rounds at alpha = 1e-3 with a fixed seed (deterministic).
"""

from __future__ import annotations

import asyncio
import types

import scipy.stats
import torch

from coordinator.backup import draft_after_miss
from coordinator.config import CoordinatorConfig
from specd.core.context_match import one_hot, prompt_lookup
from specd.core.logits import logits_to_probs, sparse_to_dense
from specd.core.sampling import SamplingSettings
from specd.core.verify import rejection_sample
from specd.v1 import common_pb2, draft_pb2
from tests.request_states import request_state

ROUNDS = 100_000


def test_prompt_lookup_continues_the_latest_match_of_the_longest_suffix():
    assert prompt_lookup([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert prompt_lookup([9, 2, 5, 8, 2, 5, 7, 2, 5], 2) == [7, 2]  # the latest "2 5" wins
    assert prompt_lookup([1, 2, 3, 9, 2, 3, 8, 1, 2, 3], 1) == [9]  # "1 2 3" beats "2 3"
    assert prompt_lookup([1, 2, 3], 2) == []
    assert prompt_lookup([5], 2) == []
    assert prompt_lookup([1, 2, 1, 2], 0) == []


def test_prompt_lookup_runs_a_repeating_stretch_on_past_the_history():
    """A match p tokens back continues with period p for every token asked, not p tokens."""
    assert prompt_lookup([7, 7], 3) == [7, 7, 7]
    assert prompt_lookup([5, 1, 2, 3, 1, 2, 3], 5) == [1, 2, 3, 1, 2]
    assert prompt_lookup([4, 9, 8, 4, 9], 4) == [8, 4, 9, 8]  # a match earlier on copies on the same way


class _ProposingDraft:
    """A draft link that answers Propose with fixed tokens and counts the calls."""

    def __init__(self):
        self.info = types.SimpleNamespace(vocab_size=32)
        self.proposals = 0

    def room(self, committed: int) -> int:
        return 512 - committed  # a context of 512 tokens, as DraftLink.room reads the draft's Info

    async def propose(self, session, committed, num_tokens, sampling, max_support, saguaro=None):
        self.proposals += 1
        tokens = list(range(20, 20 + num_tokens))
        dists = [common_pb2.SparseDistribution(token_ids=[t], probs=[1.0]) for t in tokens]
        return draft_pb2.ProposeResponse(draft_tokens=tokens, draft_probs=dists)


def _miss_draft(history: list[int], draft: _ProposingDraft):
    state = request_state(history, k=3, max_len=64)
    return asyncio.run(draft_after_miss(state, draft, CoordinatorConfig(), "ngram", 3))


def test_ngram_backup_guesses_where_the_history_matches_and_proposes_where_it_does_not():
    draft = _ProposingDraft()
    guessed = _miss_draft([1, 2, 3, 1, 2], draft)
    assert (guessed.tokens, guessed.source, draft.proposals) == ([3, 1, 2], "ngram", 0)
    # No suffix recurs: an empty guess would verify no draft at all, one token for the round.
    proposed = _miss_draft([1, 2, 3, 4, 5], draft)
    assert (proposed.tokens, proposed.source, draft.proposals) == ([20, 21, 22], "jit", 1)


def test_one_hot_guess_is_exact_at_temperature_one():
    """A guessed token with q = one-hot: accepted with probability p(x), else t* ~ p without x."""
    vocab = 16
    generator = torch.Generator().manual_seed(4)
    target_row = logits_to_probs(torch.randn(vocab, generator=generator) * 1.5, SamplingSettings(temperature=1.0, top_p=0.9))
    guess = int(torch.argmax(target_row))
    draft_dense = sparse_to_dense(one_hot([guess]), vocab)  # [1, V]
    result = rejection_sample(
        target_row.expand(ROUNDS, 2, vocab),
        draft_dense.expand(ROUNDS, 1, vocab),
        torch.full((ROUNDS, 1), guess),
        torch.rand(ROUNDS, 1, dtype=torch.float64, generator=generator),
        torch.rand(ROUNDS, 2, dtype=torch.float64, generator=generator),
    )
    emitted = torch.where(result.accepted > 0, torch.tensor(guess), result.next_token)  # [R]
    counts = torch.bincount(emitted, minlength=vocab).double()
    support = target_row > 0
    assert counts[~support].sum() == 0
    expected = target_row[support].double() * ROUNDS
    assert scipy.stats.chisquare(counts[support].tolist(), (expected * counts.sum() / expected.sum()).tolist()).pvalue > 1e-3
