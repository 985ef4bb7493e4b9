"""A small draft of the default target, for the draft recipe's tests (recipes/train_draft.py)."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "recipes"))

import train_draft  # noqa: E402


def moved_small_draft(vocab: torch.Tensor):
    """A 2 + 1 layer draft over `vocab` (its own layer started as the target's layer 29) whose
    own layer and head were moved off their starting point, as training would."""
    draft = train_draft.build_draft(SimpleNamespace(borrowed_layers=2, seed=7), vocab, 1, [29])
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in draft.named_parameters():
            if name.startswith("model.layers.2.") or name.startswith("lm_head"):
                param.add_(torch.randn(param.shape, generator=generator) * 0.02)
    return draft.eval()
