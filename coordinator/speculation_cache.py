"""ssd's speculation cache: round T+1's drafts, one per guessed outcome (k, t*) of Verify(T).

The draft worker builds it beside Verify(T) (draft_service/speculation.py) and sends it as a
draft_pb2.SpeculationCache; the coordinator's DraftLink turns that into a SpeculationCache
once, and everything after looks drafts up here by outcome (specd/core/outcomes.py, the key the target shares): the round's lookup
(coordinator/ssd_rounds.py), the verifies sent ahead (coordinator/verify_ahead.py) and the
early Speculate (coordinator/ssd_speculator.py). Entries keep the draft's rank order, likeliest
guess first.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from specd.core.outcomes import Outcome, outcome_of
from specd.core.sampling import SparseDist
from specd.v1 import draft_pb2
from specd.wire.convert import sparse_list_from_proto


@dataclasses.dataclass(frozen=True)
class Draft:
    """A round's draft: its tokens and the q each was sampled from (one SparseDist per token;
    the verifier needs the q the token came from to stay exact)."""

    tokens: list[int]
    dists: list[SparseDist]


@dataclasses.dataclass(frozen=True)
class CachedDraft:
    """One cache entry: the draft after outcome (accepted, next_token), in wire form (a verify
    sent ahead forwards it as is; only the entry a round uses is converted)."""

    accepted: int
    next_token: int
    entry: draft_pb2.SpeculationEntry

    @property
    def outcome(self) -> Outcome:
        return outcome_of(self)

    @property
    def tokens(self) -> list[int]:
        return list(self.entry.draft_tokens)

    def draft(self, count: int | None = None) -> Draft:
        """Its first `count` tokens (all by default) and their q."""
        return Draft(list(self.entry.draft_tokens[:count]), sparse_list_from_proto(self.entry.draft_probs[:count]))


class SpeculationCache:
    """A built cache, looked up by outcome; iterates its entries likeliest first."""

    def __init__(self, entries: list[CachedDraft], forward_ms: float = 0.0):
        self._ranked = entries
        self._by_outcome = {entry.outcome: entry for entry in reversed(entries)}  # the first-ranked wins a tie
        self.forward_ms = forward_ms  # the draft's build time

    @classmethod
    def from_wire(cls, cache: draft_pb2.SpeculationCache) -> "SpeculationCache":
        entries = [CachedDraft(entry.accepted, entry.next_token, entry) for entry in cache.entries]
        return cls(entries, cache.forward_ms)

    def __len__(self) -> int:
        return len(self._ranked)

    def __iter__(self) -> Iterator[CachedDraft]:
        return iter(self._ranked)

    def lookup(self, outcome: Outcome) -> CachedDraft | None:
        """The draft for Verify(T)'s `outcome`, None if the draft did not guess it."""
        return self._by_outcome.get(outcome)

    def first_with(self, accepted: int) -> CachedDraft | None:
        """The draft's first-ranked guess among the outcomes that accept `accepted` tokens."""
        return next((entry for entry in self._ranked if entry.accepted == accepted), None)
