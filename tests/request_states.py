"""A request's state (coordinator/request_state.py) built for tests that drive a round loop by hand."""

from __future__ import annotations

import dataclasses

from coordinator.policy import SpeculationPolicy
from coordinator.profiles import CPU
from coordinator.request_state import RequestState
from specd.core.sampling import SamplingSettings


def request_state(
    committed: list[int],
    mode: str = "ssd",
    k: int = 3,
    max_len: int = 64,
    sampling: SamplingSettings | None = None,
    session_id: str = "s",
    **profile_changes,
) -> RequestState:
    """A request of `mode` asking K = `k`, with the CPU profile changed by `profile_changes`."""
    sampling = sampling or SamplingSettings()
    policy = SpeculationPolicy(mode, k, sampling, dataclasses.replace(CPU, **profile_changes))
    return RequestState(session_id, list(committed), sampling, policy, max_support=64, return_logprobs=False, max_len=max_len)
