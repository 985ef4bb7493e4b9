"""Sampling: a seed reproduces a sample and changes it, an unseeded sample reports the seed that
replays it, and logprobs are the target's raw log-softmax at each drawn token."""

from __future__ import annotations

import pytest
import torch

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import (
    CALL_TIMEOUT_S,
    full_logits,
    request,
)
from tests.e2e.trio.conftest import PROMPTS


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_OFF], ids=["sd", "off"])
def test_sampling_is_reproducible_by_seed(stub, reference, mode):
    _, _, prompts, greedy = reference
    ids = prompts[PROMPTS[4]]

    def run(seed):
        response = stub.Generate(request(ids, mode=mode, temperature=1.0, seed=seed, max_new_tokens=32), timeout=CALL_TIMEOUT_S)
        assert response.stats.seed == seed
        assert response.stats.mode == mode
        return list(response.token_ids)

    first = run(1234)
    assert run(1234) == first
    others = [run(seed) for seed in (1, 2)]
    assert any(o != first for o in others), "the seed does not change the sample"
    assert len(first) == 32


def test_unseeded_sampling_reports_its_seed_and_replays(stub, reference):
    _, _, prompts, _ = reference
    ids = prompts[PROMPTS[5]]
    first = stub.Generate(request(ids, temperature=1.0, max_new_tokens=24), timeout=CALL_TIMEOUT_S)
    replay = stub.Generate(request(ids, temperature=1.0, seed=first.stats.seed, max_new_tokens=24), timeout=CALL_TIMEOUT_S)
    assert list(replay.token_ids) == list(first.token_ids)


def test_logprobs_are_the_targets_raw_log_softmax(stub, reference):
    model, _, prompts, _ = reference
    ids = prompts[PROMPTS[6]]
    for mode, temperature in ((pb.SPECULATION_MODE_SD, 0.0), (pb.SPECULATION_MODE_SD, 0.8), (pb.SPECULATION_MODE_OFF, 1.0)):
        message = request(ids, mode=mode, temperature=temperature, seed=5, max_new_tokens=24, return_logprobs=True)
        message.sampling.top_k = 20
        response = stub.Generate(message, timeout=CALL_TIMEOUT_S)
        tokens = list(response.token_ids)
        assert len(response.logprobs) == len(tokens) == 24
        assert all(lp <= 0 for lp in response.logprobs)
        logits = full_logits(model, ids + tokens)[len(ids) - 1 : -1]  # [24, V]: the logits each token was drawn after
        want = logits.log_softmax(-1).gather(-1, torch.tensor(tokens).unsqueeze(-1)).squeeze(-1)
        torch.testing.assert_close(torch.tensor(list(response.logprobs)), want, rtol=0, atol=1e-4)
    without = stub.Generate(request(ids, max_new_tokens=8), timeout=CALL_TIMEOUT_S)
    assert len(without.logprobs) == 0
