"""The coordinator's tuned defaults, one profile per device the target runs on.

The coordinator takes the profile of the backend its target worker reports (its Info) and a
flag set on the command line overrides the profile's value. Each value has one line saying
which measurement chose it; the measurements themselves are in docs/decisions.md.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class SpeculationProfile:
    num_speculative_tokens: int  # K when a request does not say
    ssd_budget: int  # most branches of an ssd tree
    speculation_max_running: int  # requests at once past which each speculates less (0: no limit)
    ssd_backup: str  # the draft of an ssd round whose lookup missed: ngram or jit
    few_tokens: float  # auto: speculative rounds yielding fewer tokens than this are cut short
    acceptance_prior: float  # a request's per-token acceptance before its first verify
    acceptance_prior_weight: float = 2.0  # the prior's weight, in rounds
    acceptance_decay: float = 0.9  # per round: recent rounds dominate the estimate
    ssd_fanout_r: float = 0.5  # the power-law exponent of the miss rate (the Saguaro paper's model)


CPU = SpeculationProfile(
    num_speculative_tokens=3,  # benchmarks/sweep_k.py: K = 3 led 2 and 4 in sd and ssd on the default pair
    ssd_budget=6,  # benchmarks/ab_ssd.py: 6 branches ran level with 5 and ahead of 8 and 12 once a verify took ~40 ms
    speculation_max_running=2,  # specd bench --concurrency 1,8: ssd 1.71x off at one stream, 0.97x at eight
    ssd_backup="ngram",  # benchmarks/ab_ssd.py: prompt lookup 28.2 against a just-in-time Propose's 26.7 tokens/s
    few_tokens=1.5,  # benchmarks/time_modes.py: an ssd round cost 1.5-1.75 target-only rounds on 2 cores
    acceptance_prior=0.7,  # not measured: it weighs two rounds, so a request's own acceptance replaces it within a few
)
# Not measured on a GPU yet: the CPU profile's values until `specd bench` runs on one.
CUDA = dataclasses.replace(CPU)

PROFILES = {"cpu": CPU, "cuda": CUDA}


def profile_for(backend: str, overrides: dict | None = None) -> SpeculationProfile:
    """The profile of a target worker's backend (its Info's `backend`, else its device; CPU for an
    unknown one), with the settings the coordinator's flags set instead."""
    return dataclasses.replace(PROFILES.get(backend.split(":")[0], CPU), **(overrides or {}))
