"""A request near the context's end: the trees beside its last verifies fit in what is left.

A Speculate whose deepest branch would pass the context is refused by the draft, and the
coordinator would take the draft for down. The tree drafts only as deep as there is room for.
"""

from __future__ import annotations

import pytest

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, assert_greedy_equal_or_near_tie, greedy_reference, load_reference, request, running_stack


def _prompt(count: int) -> list[int]:
    return [5 + (i * 7) % 300 for i in range(count)]


@pytest.fixture(scope="module")
def target_model(tiny_pair):
    model, _ = load_reference(tiny_pair[0])
    return model


@pytest.mark.parametrize("left", [2, 3, 5, 8])
def test_ssd_near_the_context_end_builds_trees_that_fit_and_keeps_the_draft(tiny_pair, target_model, left):
    """The last rounds' Speculate asks for no more tree than the context holds: a draft that
    refused it would be taken for down, and the request would say so in fallback_reason."""
    context = target_model.config.max_position_embeddings
    prompt = _prompt(context - left)
    want = greedy_reference(target_model, prompt, left)
    with running_stack(*tiny_pair) as stack:
        response = stack.stub().Generate(
            request(prompt, mode=pb.SPECULATION_MODE_SSD, k=4, max_new_tokens=48), timeout=CALL_TIMEOUT_S
        )
        assert stack.coordinator.servicer.draft.usable()
    assert_greedy_equal_or_near_tie(target_model, prompt, list(response.token_ids), want)
    assert response.finish_reason == pb.FINISH_REASON_LENGTH
    assert response.stats.fallback_reason == ""
    assert response.stats.mode == pb.SPECULATION_MODE_SSD
