"""The runners' calls one at a time, as tests drive them without a servicer: the target's through
run_batch (a batch of one), the draft's step jobs run alone on the calling thread."""

from __future__ import annotations

from draft_service.speculation import SpeculationResult
from specd.engine.step_batcher import run_alone
from target_service.calls import PrefillCall, VerifyCall
from target_service.verify_decision import VerifyOutcome


def target_prefill(runner, session_id: str, start: int, tokens: list[int]) -> tuple[int, float]:
    """Cache every committed token but the last; (cached tokens, forward ms)."""
    return _one(runner, PrefillCall(session_id, start, tokens))


def target_verify(runner, session_id, start, tokens, draft_tokens, draft_dists, sampling, return_logprobs) -> VerifyOutcome:
    """One forward over [last committed token, d_1..d_K], then the ratio test."""
    return _one(runner, VerifyCall(session_id, start, tokens, draft_tokens, draft_dists, sampling, return_logprobs))


def _one(runner, call):
    (result,) = runner.run_batch([call])
    if isinstance(result, BaseException):
        raise result
    return result


def draft_propose(runner, *args, **kwargs):
    """A Propose alone; the arguments are DraftModelRunner.propose_job's."""
    return run_alone(runner.propose_job(*args, **kwargs))


def draft_speculate(runner, *args, **kwargs) -> SpeculationResult:
    """A Speculate's tree built alone; the arguments are DraftModelRunner.speculate_job's."""
    return run_alone(runner.speculate_job(*args, **kwargs))
