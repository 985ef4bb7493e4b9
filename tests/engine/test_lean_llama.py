"""specd/engine/lean_llama.py: the draft's lean Llama forward gives bitwise the model's own logits."""

from __future__ import annotations

import pytest
import torch

from specd.engine.kv_cache import GrowingKVCache
from specd.engine.lean_llama import LeanLlama, LeanOutput, lean_or_plain
from tests.tiny_models import build_llama, tree_step_inputs

VOCAB = 96


@pytest.fixture(scope="module")
def model():
    return build_llama(VOCAB, seed=11, hidden=32, layers=2)


def _both(model, lean, steps: list[dict]) -> None:
    """Run each step's keyword arguments through both on their own caches; logits must match."""
    plain_cache, lean_cache = GrowingKVCache(), GrowingKVCache()
    with torch.inference_mode():
        for index, kwargs in enumerate(steps):
            want = model(past_key_values=plain_cache, use_cache=True, **kwargs).logits
            got = lean(past_key_values=lean_cache, **kwargs).logits
            assert torch.equal(want, got), f"step {index}"


def test_prefill_verify_and_single_steps_match(model):
    generator = torch.Generator().manual_seed(1)
    ids = lambda n: torch.randint(1, VOCAB, (1, n), generator=generator)  # noqa: E731  [1, n]
    _both(model, LeanLlama(model), [
        {"input_ids": ids(12)},
        {"input_ids": ids(5), "logits_to_keep": 5},
        {"input_ids": ids(1)},
        {"input_ids": ids(1), "logits_to_keep": 1},
    ])


def test_tree_steps_with_a_4d_mask_match(model):
    _both(model, LeanLlama(model), tree_step_inputs(model.config, VOCAB))


def test_lean_only_for_llama_and_only_when_the_probe_agrees(model, monkeypatch):
    assert isinstance(lean_or_plain(model), LeanLlama)

    import transformers

    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=VOCAB)).eval()
    assert lean_or_plain(gpt2) is gpt2

    real_call = LeanLlama.__call__

    def off_by_a_little(self, *args, **kwargs):
        out = real_call(self, *args, **kwargs)
        return LeanOutput(logits=out.logits + 1e-6)

    monkeypatch.setattr(LeanLlama, "__call__", off_by_a_little)
    assert lean_or_plain(model) is model
