"""Outcome keys (specd/core/outcomes.py) read off the wire messages that carry several of them."""

from __future__ import annotations

from typing import Iterable

from specd.core.outcomes import Outcome, outcome_of
from specd.v1 import draft_pb2, target_pb2


def guessed_outcomes(guesses: draft_pb2.SpeculationGuesses) -> set[Outcome]:
    """The outcomes a speculation cache will hold, as the draft names them before building it."""
    return set(zip(guesses.accepted, guesses.next_token))


def choices_by_outcome(choices: Iterable[target_pb2.VerifyChoice]) -> dict[Outcome, target_pb2.VerifyRequest]:
    """A VerifyAfter's verifies by the outcome each is written for."""
    return {outcome_of(choice): choice.verify for choice in choices}
