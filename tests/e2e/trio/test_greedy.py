"""Greedy output equals the target run alone (up to near-ties): in every speculation mode and k,
from a text or a token prompt, under a repetition penalty, and for concurrent requests."""

from __future__ import annotations

import concurrent.futures

import pytest

from specd.v1 import coordinator_pb2 as pb
from tests.conftest import (
    CALL_TIMEOUT_S,
    assert_greedy_equal_or_near_tie,
    greedy_reference,
    request,
)
from tests.e2e.trio.conftest import MAX_NEW, PROMPTS


@pytest.mark.parametrize(
    "mode, k",
    [(pb.SPECULATION_MODE_SD, 1), (pb.SPECULATION_MODE_SD, 4), (pb.SPECULATION_MODE_SD, 8), (pb.SPECULATION_MODE_OFF, 4)],
    ids=["sd-k1", "sd-k4", "sd-k8", "off"],
)
def test_greedy_equals_target_alone(stub, reference, mode, k):
    model, _, prompts, greedy = reference
    for text in PROMPTS[:4]:
        response = stub.Generate(request(prompts[text], mode=mode, k=k, max_new_tokens=MAX_NEW), timeout=CALL_TIMEOUT_S)
        assert response.finish_reason == pb.FINISH_REASON_LENGTH
        assert response.usage.completion_tokens == MAX_NEW
        assert response.usage.prompt_tokens == len(prompts[text])
        assert response.stats.mode == mode
        assert not response.stats.fallback_reason
        assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), greedy[text])
        if mode == pb.SPECULATION_MODE_SD:
            assert response.stats.draft_tokens > 0
            assert response.stats.rounds < MAX_NEW  # the draft saved target forwards
        else:
            assert response.stats.rounds == MAX_NEW and response.stats.draft_tokens == 0


def test_text_prompt_equals_token_prompt(stub, reference):
    model, tokenizer, prompts, greedy = reference
    text = PROMPTS[0]
    response = stub.Generate(request(prompt=text), timeout=CALL_TIMEOUT_S)
    assert response.usage.prompt_tokens == len(prompts[text])
    assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), greedy[text])
    assert response.text == tokenizer.decode(list(response.token_ids), skip_special_tokens=True)


def test_concurrent_requests_get_their_own_answers(stub, reference):
    model, _, prompts, greedy = reference
    new_tokens = 24

    def one(text: str):
        k = 1 + PROMPTS.index(text) % 4
        return text, stub.Generate(request(prompts[text], k=k, max_new_tokens=new_tokens), timeout=CALL_TIMEOUT_S)

    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        results = list(pool.map(one, PROMPTS))
    assert len(results) == 8
    for text, response in results:
        assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), greedy[text][:new_tokens])


PENALTY = 1.5


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD], ids=["off", "sd", "ssd"])
def test_greedy_under_a_repetition_penalty_equals_target_alone(stub, reference, mode):
    """The target applies the penalty over the prompt and every token before each verified
    position, drafts included, as transformers' generate(repetition_penalty=...) does."""
    model, _, prompts, greedy = reference
    changed = 0
    for text in PROMPTS[:4]:
        want = greedy_reference(model, prompts[text], MAX_NEW, repetition_penalty=PENALTY)
        changed += want != greedy[text]
        message = request(prompts[text], mode=mode, max_new_tokens=MAX_NEW)
        message.sampling.repetition_penalty = PENALTY
        response = stub.Generate(message, timeout=CALL_TIMEOUT_S)
        assert response.stats.mode == mode and not response.stats.fallback_reason
        assert_greedy_equal_or_near_tie(model, prompts[text], list(response.token_ids), want, repetition_penalty=PENALTY)
        if mode != pb.SPECULATION_MODE_OFF:
            assert response.stats.accepted_tokens > 0
    assert changed, "the penalty changed no reference: this test would pass with it ignored"
