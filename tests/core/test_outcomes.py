"""The outcome key (k, t*) is read one way on both sides: the coordinator's cache lookup by a
verify's answer and the target's choice for that answer pick the same draft."""

from __future__ import annotations

from coordinator.speculation_cache import SpeculationCache
from specd.core.outcomes import outcome_of
from specd.v1 import common_pb2, draft_pb2, target_pb2
from specd.wire.outcomes import choices_by_outcome, guessed_outcomes

ENTRIES = [(2, 7, [11, 12]), (0, 9, [13]), (2, 8, [14, 15])]  # the draft's rank order


def _wire_cache() -> draft_pb2.SpeculationCache:
    return draft_pb2.SpeculationCache(
        entries=[draft_pb2.SpeculationEntry(accepted=k, next_token=t, draft_tokens=d) for k, t, d in ENTRIES]
    )


def _choices(cache: SpeculationCache) -> list[target_pb2.VerifyChoice]:
    """One VerifyAfter choice per cached outcome, each verifying its entry's draft (as sent ahead)."""
    return [
        target_pb2.VerifyChoice(
            accepted=entry.accepted,
            next_token=entry.next_token,
            verify=target_pb2.VerifyRequest(session_id="s", committed=common_pb2.CommittedTokens(start=4), draft_tokens=entry.tokens),
        )
        for entry in cache
    ]


def test_the_target_runs_the_draft_the_coordinator_looks_up():
    cache = SpeculationCache.from_wire(_wire_cache())
    by_outcome = choices_by_outcome(_choices(cache))
    assert set(by_outcome) == {(2, 7), (0, 9), (2, 8)}
    for accepted, next_token in [(2, 7), (0, 9), (2, 8), (1, 7)]:
        answer = target_pb2.VerifyResponse(accepted=accepted, next_token=next_token)
        found = cache.lookup(outcome_of(answer))
        chosen = by_outcome.get(outcome_of(answer))
        assert (found is None) == (chosen is None)
        if found is not None:
            assert list(chosen.draft_tokens) == found.tokens


def test_guesses_name_the_outcomes_the_cache_holds():
    cache = SpeculationCache.from_wire(_wire_cache())
    guesses = draft_pb2.SpeculationGuesses(accepted=[k for k, _, _ in ENTRIES], next_token=[t for _, t, _ in ENTRIES])
    assert guessed_outcomes(guesses) == {entry.outcome for entry in cache}
