"""The default target as the draft recipe uses it: loaded as the target worker loads it, and the
size of its vocabulary."""

from __future__ import annotations

import json

import torch


def load_target(threads: int, device: str = "cpu"):
    """(model, tokenizer) of the default target, as the target worker loads it (fp32), on `device`."""
    from specd.engine.default_pair import DEFAULT_TARGET
    from specd.engine.loading import load_causal_lm

    torch.set_num_threads(threads)
    loaded = load_causal_lm(DEFAULT_TARGET)
    return loaded.model.to(device), loaded.tokenizer


def target_vocab_size() -> int:
    from specd.engine.default_target import target_folder

    return json.loads((target_folder() / "config.json").read_text())["vocab_size"]
