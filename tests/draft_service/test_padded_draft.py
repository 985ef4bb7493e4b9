"""A draft whose checkpoint pads its embedding past the tokenizer still drafts only real tokens."""

from __future__ import annotations

import torch

from draft_service.config import DraftConfig
from draft_service.server import load_runner
from specd.core.sampling import SamplingSettings
from tests.runner_calls import draft_propose
from tests.tiny_models import build_llama, build_tokenizer


def test_padded_embedding_rows_are_never_proposed(tmp_path):
    tokenizer = build_tokenizer()
    padded = build_llama(len(tokenizer) + 64, seed=3, eos_id=tokenizer.eos_token_id)
    with torch.no_grad():  # make the padding rows the most likely tokens everywhere
        padded.lm_head.weight[len(tokenizer) :] = padded.lm_head.weight[: len(tokenizer)].abs().max() * 10
    padded.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)

    runner = load_runner(DraftConfig(model=str(tmp_path), device="cpu"))
    assert runner.loaded.vocab_size == len(tokenizer)
    prompt = tokenizer.encode("def add(a, b):")
    for sampling in (SamplingSettings(temperature=0.0), SamplingSettings(temperature=1.0, seed=7)):
        proposal = draft_propose(runner, f"s-{sampling.temperature}", 0, prompt, 6, sampling, 64)
        assert all(0 <= t < len(tokenizer) for t in proposal.draft_tokens)
        assert all(i < len(tokenizer) for dist in proposal.draft_dists for i in dist.token_ids)
