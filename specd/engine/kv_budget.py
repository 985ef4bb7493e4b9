"""A worker's KV budget: the bytes its sessions' caches may take, and what one token takes.

Sessions are admitted by the room they reserve (the most tokens their request can reach, as the
coordinator says when it opens one), so that a worker refuses a session it could not hold instead
of running out of device memory part-way through a request.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import torch

from specd.core.errors import TooManySessions

_MIB = 1 << 20
# Of the device memory free now, the most a budget takes: other processes' memory is not ours.
_FREE_SHARE = 0.95


@dataclasses.dataclass(frozen=True)
class KVBudget:
    bytes_per_token: int = 0  # KV bytes one cached token takes over all layers (0: not known)
    budget_bytes: int = 0  # most bytes the sessions may hold or reserve (0: no limit)
    max_tokens: int = 0  # most tokens one session reserves (the model's context length; 0: no limit)

    def clamp(self, reserve_tokens: int) -> int:
        """The reservation a session gets: what it asked, within the model's context."""
        return min(reserve_tokens, self.max_tokens) if self.max_tokens else reserve_tokens

    def bytes_for(self, tokens: int) -> int:
        return tokens * self.bytes_per_token

    def admit(self, reserve_tokens: int, held_tokens: Callable[[], int]) -> None:
        """Refuse (TooManySessions: RESOURCE_EXHAUSTED) a session whose reservation does not fit
        beside the tokens the open sessions hold or reserve (`held_tokens()`, counted only when
        there is a budget to count against)."""
        if not self.budget_bytes:
            return
        needed, free = self.bytes_for(reserve_tokens), self.budget_bytes - self.bytes_for(held_tokens())
        if needed > free:
            raise TooManySessions(
                f"this worker's KV cache budget of {self.budget_bytes / _MIB:.0f} MiB has {max(free, 0) / _MIB:.0f} MiB free; "
                f"a session of {reserve_tokens} tokens needs {needed / _MIB:.1f} MiB; retry later"
            )


def kv_layout(model: torch.nn.Module, shards: int = 1) -> tuple[int, int, int]:
    """(layers, key/value heads, head dim) of `model`'s cache on one rank; `shards`: the
    tensor-parallel ranks its key/value heads are split across (each rank holds its share)."""
    config = model.config.get_text_config()
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, -(-kv_heads // shards), head_dim  # a rank holds at most that many heads


def kv_bytes_per_token(model: torch.nn.Module, shards: int = 1) -> int:
    """Bytes of keys and values one token takes in every layer of `model`'s cache on one rank."""
    layers, kv_heads, head_dim = kv_layout(model, shards)
    element = torch.empty((), dtype=model.dtype).element_size()
    return 2 * layers * kv_heads * head_dim * element


def budget_bytes(setting: int, device: torch.device | str, memory_fraction: float = 0.9) -> int:
    """The budget --kv-cache-bytes asks for: N bytes, 0 for none, or -1 for the device's default.
    On a GPU that is `memory_fraction` of its memory less what this process took to load and warm
    up its model (its weights and the activations' peak), within what is free now: a share of the
    whole device, so that two workers on one GPU, loading in either order, each keep to their own.
    On a CPU none: sessions are capped by count."""
    if setting >= 0:
        return setting
    device = torch.device(device)
    if device.type != "cuda":
        return 0
    free, total = torch.cuda.mem_get_info(device)
    taken = torch.cuda.max_memory_reserved(device)  # this process's own: weights, warm-up's activations
    return max(0, min(int(total * memory_fraction) - taken, int(free * _FREE_SHARE)))
