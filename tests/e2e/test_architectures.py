"""Other model families than Llama through the whole stack: greedy sd and ssd (the tree's hit
path and forced misses) give the target's own greedy output.

Each family stresses a different part: learned absolute positions, partial rotary embeddings,
sliding-window layers beside full ones (the tree mask must apply the window), soft-capped logits.
"""

from __future__ import annotations

import grpc
import pytest

from specd.v1 import coordinator_pb2 as pb
from specd.v1 import coordinator_pb2_grpc
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    load_reference,
    request,
    running_stack,
)
from tests.tiny_models import save_pair

MAX_NEW = 40  # past the 16-token windows, with the prompt
PROMPTS = ["def add(a, b):", "class Point:\n    def"]
HIT = dict(ssd_budget=16, ssd_backup="jit")
MISS = dict(ssd_budget=0, ssd_backup="jit")


@pytest.mark.parametrize("architecture", ["gpt2", "gpt_neox", "qwen2", "gemma2"])
def test_greedy_sd_and_ssd_equal_the_target(architecture, tmp_path):
    target, draft = save_pair(tmp_path, architecture=architecture)
    model, tokenizer = load_reference(target)
    with running_stack(target, draft, coordinator_overrides=HIT) as stack:
        miss_service = None
        try:
            stack.coordinator_overrides = MISS
            miss_service = stack.run(stack._start_coordinator())
            stubs = {
                "hit": stack.stub(),
                "miss": coordinator_pb2_grpc.CoordinatorStub(grpc.insecure_channel(f"127.0.0.1:{miss_service.port}")),
            }
            hits = 0
            accepted = {"ssd": 0, "sd after round 0": 0}
            for text in PROMPTS:
                ids = tokenizer.encode(text, add_special_tokens=True)
                want = greedy_reference(model, ids, MAX_NEW)
                for name, mode in (("hit", pb.SPECULATION_MODE_SD), ("hit", pb.SPECULATION_MODE_SSD), ("miss", pb.SPECULATION_MODE_SSD)):
                    response = stubs[name].Generate(request(ids, mode=mode, k=4, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
                    assert response.stats.mode == mode, response.stats.fallback_reason
                    assert_greedy_equal_or_near_tie(model, ids, list(response.token_ids), want)
                    if name == "hit" and mode == pb.SPECULATION_MODE_SSD:
                        accepted["ssd"] += response.stats.accepted_tokens
                        hits += response.stats.cache_hits
                # ssd's round 0 drafts nothing and commits the first token; from there every
                # round drafts what sd's Propose drafts after the same tokens.
                after_round_0 = stubs["hit"].Generate(
                    request(ids + want[:1], mode=pb.SPECULATION_MODE_SD, k=4, max_new_tokens=MAX_NEW - 1), timeout=CALL_TIMEOUT_S
                )
                accepted["sd after round 0"] += after_round_0.stats.accepted_tokens
            assert hits > 0, "the hit path never ran"
            # A cache entry is the Propose it stands for, so the same drafts are accepted.
            assert accepted["ssd"] == accepted["sd after round 0"]
        finally:
            if miss_service is not None:
                stack.run(miss_service.stop(0), timeout=10)
