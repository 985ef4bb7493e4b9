"""A verify's outcome (k, t*): k draft tokens accepted, then next token t*. The one key that
ssd's two sides share: the draft guesses outcomes and drafts after each (its speculation
cache), the coordinator looks that cache up by the outcome a verify reports
(coordinator/speculation_cache.py) and sends round T+1 ahead as one choice per cached outcome
(coordinator/verify_ahead.py), and the target runs the choice written for the outcome its
forward gave (target_service/verify_after.py). Every wire message that names an outcome carries it
as the fields `accepted` and `next_token`; these read it, so that no side keys on its own.
"""

from __future__ import annotations

from typing import Protocol

Outcome = tuple[int, int]  # (k accepted, next token t*)


class _NamesAnOutcome(Protocol):
    accepted: int
    next_token: int


def outcome_of(message: _NamesAnOutcome) -> Outcome:
    """The outcome a message names: a VerifyResponse (the one that came), a SpeculationEntry or
    a VerifyChoice (the one it is written for), the target's own verify result."""
    return message.accepted, message.next_token
