"""A KV cache that grows in place instead of by concatenation.

transformers' DynamicLayer appends new keys and values with torch.cat, which copies the
whole cache on every forward of every layer. A worker forwards a few tokens at a time over
a context of hundreds (a verify, a tree step), and the draft recipe's generation one token a
row over a batch of them, so that copy is a fixed share of each forward. GrowingLayer keeps
each layer's keys and values in a buffer with spare room, writes new entries into it and hands
attention a view of the filled part; rolling back only moves the fill mark. The arithmetic is
unchanged: attention reads the same numbers, so the logits are bitwise those of DynamicLayer
(tests/engine/test_kv_cache.py checks).

A worker session's cache is made with room for the most tokens its request can reach (the
coordinator says how many when it opens the session), so that its buffers are allocated once,
at the first forward, and never copied to grow; a cache that outgrows its reservation doubles.
"""

from __future__ import annotations

import functools

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

_MIN_CAPACITY = 256  # tokens: most requests never reallocate


class GrowingLayer(DynamicLayer):
    """DynamicLayer semantics (full attention, croppable) over a buffer that doubles when full.

    reserve_tokens: the first buffer's capacity, when larger than what the first write needs.
    """

    def __init__(self, reserve_tokens: int = 0):
        super().__init__()
        self.reserve_tokens = reserve_tokens

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        super().lazy_initialization(key_states, value_states)
        self.length = 0
        self.key_buffer: torch.Tensor | None = None  # [batch, heads, capacity, head_dim]
        self.value_buffer: torch.Tensor | None = None

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs) -> tuple[torch.Tensor, torch.Tensor]:
        """Write the new entries after the filled part; return views of everything cached.

        key_states, value_states: [batch, heads, new, head_dim].
        """
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        end = self.length + key_states.shape[-2]
        if self.key_buffer is None or end > self.key_buffer.shape[-2]:
            self._reserve(key_states, value_states, end)
        self.key_buffer[..., self.length : end, :] = key_states
        self.value_buffer[..., self.length : end, :] = value_states
        self._fill_to(end)
        return self.keys, self.values

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        """New buffers with room for the reservation, or for twice `needed` tokens past it,
        holding what is cached so far."""
        capacity = self.reserve_tokens if needed <= self.reserve_tokens else max(_MIN_CAPACITY, 2 * needed)
        keys = key_states.new_empty(key_states.shape[:-2] + (capacity, key_states.shape[-1]))  # [b, h, cap, d]
        values = value_states.new_empty(value_states.shape[:-2] + (capacity, value_states.shape[-1]))
        if self.length:
            keys[..., : self.length, :] = self.key_buffer[..., : self.length, :]
            values[..., : self.length, :] = self.value_buffer[..., : self.length, :]
        self.key_buffer, self.value_buffer = keys, values

    def _fill_to(self, length: int) -> None:
        self.length = length
        self.keys = self.key_buffer[..., :length, :]  # [b, h, length, d]: a view, no copy
        self.values = self.value_buffer[..., :length, :]

    @property
    def capacity(self) -> int:
        """Tokens the buffers hold room for (0 before the first write)."""
        return 0 if self.key_buffer is None else self.key_buffer.shape[-2]

    def get_seq_length(self) -> int:
        return self.length if self.is_initialized else 0

    def crop(self, tokens_to_remove: int) -> None:
        """Drop the last `-tokens_to_remove` entries (transformers 5.x passes a negative count)."""
        if tokens_to_remove > 0:
            raise ValueError("crop takes a negative count of tokens to remove")
        if tokens_to_remove == 0 or not self.is_initialized:
            return
        self._fill_to(max(0, self.length + tokens_to_remove))

    def reset(self) -> None:
        super().reset()
        self.key_buffer = self.value_buffer = None
        self.length = 0

    def batch_repeat_interleave(self, repeats: int) -> None:
        raise NotImplementedError("specd never repeats a cache's rows")

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the batch rows `indices` [b'] (rows that ended leave a batched generation)."""
        if self.key_buffer is None:
            return
        self.key_buffer, self.value_buffer = self.key_buffer[indices], self.value_buffer[indices]  # [b', h, cap, d]
        self._fill_to(self.length)


class GrowingKVCache(DynamicCache):
    """A DynamicCache whose layers are GrowingLayers, added as the model first writes them: a
    worker session's cache, and the draft recipe's batched generation's.

    reserve_tokens: each layer's first capacity (0: what the first write needs, doubled, at least
    _MIN_CAPACITY).
    """

    def __init__(self, reserve_tokens: int = 0):
        super().__init__()
        self.layer_class_to_replicate = functools.partial(GrowingLayer, reserve_tokens)

    def capacity_tokens(self) -> int:
        """Tokens of room each layer holds (the largest, should layers differ)."""
        return max((layer.capacity for layer in self.layers if isinstance(layer, GrowingLayer)), default=0)


def croppable(cache: DynamicCache) -> bool:
    """Whether every layer can drop its last entries (full attention, no window or recurrent state)."""
    return all(type(layer) is DynamicLayer or isinstance(layer, GrowingLayer) for layer in cache.layers)
