"""Attention masks for one step of the flattened speculation tree (draft_service/speculation.py).

Branch b sees the prefix up to its root, its own earlier tree tokens and itself. A model whose
layers attend through a sliding window must also see only what its window would show at the
branch's absolute position, or a branch would not be what a plain Propose after that branch
drafts (the tokens stay exact either way, since the target verifies them with the q they were
drawn from, but the cache would hit less). Positions, not cache indices, decide the window:
a plain Propose caches every token at the index of its position.
"""

from __future__ import annotations

import torch

FULL, SLIDING = "full_attention", "sliding_attention"


def tree_supported(config) -> bool:
    """Whether every layer attends in a way these masks reproduce (full or sliding window)."""
    return set(getattr(config, "layer_types", None) or [FULL]) <= {FULL, SLIDING}


def _visible(prefix_visible: torch.Tensor, prefix_len: int, step: int) -> torch.Tensor:
    """[B, prefix_len + step*B] bool: which cache entries branch b's query at `step` attends to.

    Cache layout: the prefix, then `step` blocks of B entries (block t holds every branch's
    t-th token), so branch b sees entry b of each block.
    """
    branches, device = prefix_visible.shape[0], prefix_visible.device
    prefix = torch.arange(prefix_len, device=device).unsqueeze(0) < prefix_visible.unsqueeze(1)  # [B, L0]
    tree = torch.eye(branches, dtype=torch.bool, device=device).repeat(1, step)  # [B, step*B]
    return torch.cat([prefix, tree], dim=1)  # [B, L0 + step*B]


def _in_window(prefix_visible: torch.Tensor, prefix_len: int, step: int, window: int) -> torch.Tensor:
    """[B, prefix_len + step*B] bool: entries whose position lies within `window` of the query's.

    Branch b's t-th token sits at position prefix_visible[b] + t - 1; its query at `step` at
    prefix_visible[b] + step - 1. The rule is transformers': kv position > q position - window.
    """
    device = prefix_visible.device
    blocks = torch.arange(step, device=device).unsqueeze(1) + prefix_visible.unsqueeze(0)  # [step, B]
    kv_positions = torch.cat([torch.arange(prefix_len, device=device), blocks.reshape(-1)])  # [L0 + step*B]
    q_positions = prefix_visible + step - 1  # [B]
    return kv_positions.unsqueeze(0) > (q_positions.unsqueeze(1) - window)  # [B, L0 + step*B]


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[1, 1, B, L] additive mask: 0 where visible, the dtype's minimum elsewhere."""
    mask = torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible, torch.finfo(dtype).min)
    return mask[None, None]


def tree_mask(config, prefix_visible: torch.Tensor, prefix_len: int, step: int, dtype: torch.dtype):
    """The attention mask for tree step `step` (1-based), as the model takes it.

    prefix_visible: [B] int64, how many prefix entries branch b sees (n + j_b), which is also
    the position of its first tree token. Returns a [1, 1, B, prefix_len + step*B] additive
    mask, or, for a model mixing full and sliding-window layers, one per layer type.
    """
    visible = _visible(prefix_visible, prefix_len, step)
    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if window is None or (layer_types is not None and SLIDING not in layer_types):
        return _additive(visible, dtype)
    windowed = _additive(visible & _in_window(prefix_visible, prefix_len, step, window), dtype)
    if layer_types is None:  # one kind of layer, all windowed (Mistral-style configs)
        return windowed
    return {FULL: _additive(visible, dtype), SLIDING: windowed}


class TreeMasks:
    """The masks of one build's steps 1..`steps`, made on `device`.

    Without a sliding window, step s's mask is the first prefix_len + s*B columns of the last
    step's (the blocks only add columns), so it is built once and sliced: building it took
    about a tenth of a one-layer draft's tree step. A window moves with each step's query
    positions, so windowed masks are built per step.
    """

    def __init__(self, config, prefix_visible: torch.Tensor, prefix_len: int, steps: int, dtype: torch.dtype, device):
        prefix_visible = prefix_visible.to(device)  # [B]: every mask is built where the model runs
        self._args = (config, prefix_visible, prefix_len, dtype, device)
        self._branches = prefix_visible.shape[0]
        self._whole = None
        if getattr(config, "sliding_window", None) is None:
            self._whole = tree_mask(config, prefix_visible, prefix_len, steps, dtype)  # [1, 1, B, L0 + steps*B]

    def visible_at(self, step: int) -> torch.Tensor | None:
        """Step `step`'s [B, L0 + step*B] bool mask for a packed forward (full attention only:
        packing refuses models with windowed layers); None for a windowed model."""
        config, prefix_visible, prefix_len, _, _ = self._args
        if self._whole is None:
            return None
        return _visible(prefix_visible, prefix_len, step)

    def at(self, step: int):
        """Step `step`'s mask (1-based), as tree_mask gives it."""
        config, prefix_visible, prefix_len, dtype, device = self._args
        if self._whole is not None:
            return self._whole[..., : prefix_len + step * self._branches]  # [1, 1, B, L0 + step*B]: a view
        return tree_mask(config, prefix_visible, prefix_len, step, dtype)
