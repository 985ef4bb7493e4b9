"""One KV pool per worker: every layer's keys and values for all its sessions, allocated once.

A worker with a KV budget can hold its sessions' caches in one tensor per layer instead of one
per session. Then a packed forward attends over all its sessions in one call per layer
(specd/engine/pool_attention.py) instead of one per session, writes every session's new entries
with one copy, and a cache allocates nothing to grow within its room. A session takes a contiguous
range of the pool: the room it reserves, rounded up to whole blocks of BLOCK_TOKENS, so that a
block holds one session's entries and a forward's block mask skips the blocks of every other.

A range returns to the pool when nothing holds its cache any more, not when its session ends:
a job under way on the model thread may still write to a session that an EndSession removed
from the store, and a range handed to a new session must not be written by the old one.
"""

from __future__ import annotations

import bisect
import collections
import threading
import weakref

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache

from specd.core.errors import TooManySessions
from specd.engine.kv_budget import kv_layout
from specd.engine.kv_cache import GrowingLayer

BLOCK_TOKENS = 128  # FlexAttention's default block: a range starts and ends on one
_MIB = 1 << 20


class KVPool:
    """Keys and values [1, kv_heads, tokens, head_dim] for each layer, and which ranges are taken."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, tokens: int, dtype: torch.dtype, device):
        blocks = tokens // BLOCK_TOKENS
        if blocks < 2:
            raise ValueError(f"a KV pool needs room for at least {2 * BLOCK_TOKENS} tokens, not {tokens}")
        self.tokens = blocks * BLOCK_TOKENS  # every layer's length
        # The last block is no session's: a padded forward's padding queries write to its last entry.
        self.room = self.tokens - BLOCK_TOKENS  # what sessions can take
        self.spare_index = self.tokens - 1
        shape = (1, kv_heads, self.tokens, head_dim)
        # Zeros, not empty(): attention reads whole blocks and masks afterwards, and a never-written
        # entry's NaN would survive a zero weight.
        self.keys = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]  # [1, kv, N, d] each
        self.values = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.bytes_per_token = 2 * layers * kv_heads * head_dim * self.keys[0].element_size()
        self._lock = threading.Lock()
        self._free: list[tuple[int, int]] = [(0, blocks - 1)]  # (first block, blocks), sorted by first block
        self._used_blocks = 0
        # Ranges whose caches became garbage, returned at the next allocation or count. A finalizer
        # only appends here: a collection may start while this thread holds the lock.
        self._returned: collections.deque[tuple[int, int]] = collections.deque()  # (start, tokens)

    @classmethod
    def for_model(cls, model, tokens: int, shards: int = 1) -> "KVPool":
        """A pool of `tokens` for `model`'s layers, in its dtype on its device (a rank's share of the
        key/value heads under tensor parallelism)."""
        return cls(*kv_layout(model, shards), tokens, model.dtype, model.device)

    @property
    def device(self) -> torch.device:
        return self.keys[0].device

    def used_tokens(self) -> int:
        """Tokens of room taken by ranges that something still holds."""
        with self._lock:
            self._take_returned()
            return self._used_blocks * BLOCK_TOKENS

    def check_room(self, tokens: int) -> None:
        """TooManySessions, as allocate would raise it, when no free range holds `tokens` now."""
        blocks = _blocks(tokens)
        with self._lock:
            self._take_returned()
            if not any(free >= blocks for _, free in self._free):
                raise self._refusal(blocks)

    def allocate(self, tokens: int) -> "KVRegion":
        """A range of room for `tokens` (the first that fits), cleared; TooManySessions when none does."""
        blocks = _blocks(tokens)
        with self._lock:
            self._take_returned()
            for i, (first, free) in enumerate(self._free):
                if free >= blocks:
                    self._free[i : i + 1] = [(first + blocks, free - blocks)] if free > blocks else []
                    self._used_blocks += blocks
                    region = KVRegion(self, first * BLOCK_TOKENS, blocks * BLOCK_TOKENS)
                    break
            else:
                raise self._refusal(blocks)
        self._clear(region.start, region.end)
        return region

    def _refusal(self, blocks: int) -> TooManySessions:
        """Why a range of `blocks` is refused (the lock held)."""
        largest = max((free for _, free in self._free), default=0)
        return TooManySessions(
            f"this worker's KV pool of {self.room} tokens ({self.room * self.bytes_per_token / _MIB:.0f} MiB) has no free "
            f"range of {blocks * BLOCK_TOKENS} tokens (the largest is {largest * BLOCK_TOKENS}); retry later"
        )

    def extend(self, region: "KVRegion", tokens: int) -> "KVRegion | None":
        """`region` grown in place to room for `tokens`, the blocks after it taken and cleared, when
        they are free; else None. The returned region stands for both: `region` no longer returns."""
        blocks = _blocks(tokens) - region.capacity // BLOCK_TOKENS
        if blocks <= 0:
            return region
        after = region.end // BLOCK_TOKENS
        with self._lock:
            self._take_returned()
            i = bisect.bisect_left(self._free, (after, 0))
            if i == len(self._free) or self._free[i][0] != after or self._free[i][1] < blocks:
                return None
            free = self._free[i][1]
            self._free[i : i + 1] = [(after + blocks, free - blocks)] if free > blocks else []
            self._used_blocks += blocks
        self._clear(region.end, region.end + blocks * BLOCK_TOKENS)
        region.stop_returning()  # only now: had the clearing failed, the range would still be whole
        return KVRegion(self, region.start, region.capacity + blocks * BLOCK_TOKENS)

    def _clear(self, start: int, end: int) -> None:
        """Zeros in tokens [start, end) of every layer: attention reads a session's blocks whole and
        masks afterwards, and a value a previous session left there would survive a zero weight if
        it were not finite."""
        for keys, values in zip(self.keys, self.values):
            keys[..., start:end, :].zero_()  # [1, kv, end - start, d]: a view of the pool
            values[..., start:end, :].zero_()

    def _release(self, start: int, tokens: int) -> None:
        """A range's cache is garbage (its region's finalizer, on any thread, maybe inside the lock)."""
        self._returned.append((start, tokens))

    def _take_returned(self) -> None:
        """Put the returned ranges back among the free ones, merging neighbours (the lock held)."""
        while self._returned:
            start, tokens = self._returned.popleft()
            first, blocks = start // BLOCK_TOKENS, tokens // BLOCK_TOKENS
            self._used_blocks -= blocks
            i = bisect.bisect(self._free, (first, blocks))
            self._free.insert(i, (first, blocks))
            if i + 1 < len(self._free) and first + blocks == self._free[i + 1][0]:
                blocks += self._free.pop(i + 1)[1]
                self._free[i] = (first, blocks)
            if i > 0 and self._free[i - 1][0] + self._free[i - 1][1] == first:
                before = self._free.pop(i - 1)
                self._free[i - 1] = (before[0], before[1] + blocks)


class KVRegion:
    """A range of the pool: tokens [start, end) of every layer. It returns to the pool when it is
    garbage (see the module's docstring)."""

    def __init__(self, pool: KVPool, start: int, capacity: int):
        self.pool, self.start, self.capacity = pool, start, capacity
        self._returns = weakref.finalize(self, pool._release, start, capacity)

    def stop_returning(self) -> None:
        """A larger region over the same start stands for this one (KVPool.extend)."""
        self._returns.detach()

    @property
    def end(self) -> int:
        return self.start + self.capacity


class _Placement:
    """Where a cache's layers live in the pool: one region for all of them, moved together. It
    refers to its layers weakly: no reference cycle keeps a finished session's range taken until
    the garbage collector runs."""

    def __init__(self, region: KVRegion):
        self.region = region
        self.layers: list[weakref.ref] = []  # to PooledLayers

    def grow(self, needed: int) -> None:
        """Room for twice `needed` tokens, or `needed` where the pool has no more: in place when the
        blocks after the range are free (nothing moves), else every layer moved to a new range,
        keeping what it caches."""
        pool = self.region.pool
        grown = pool.extend(self.region, 2 * needed) or pool.extend(self.region, needed)
        if grown is None:
            try:
                grown = pool.allocate(2 * needed)
            except TooManySessions:
                grown = pool.allocate(needed)
        old, self.region = self.region, grown
        for ref in self.layers:
            layer = ref()
            if layer is not None:
                layer.rebind(old)


class PooledLayer(GrowingLayer):
    """A GrowingLayer whose buffers are its placement's range of one pool layer."""

    def __init__(self, placement: _Placement, layer_idx: int):
        super().__init__()
        self.placement, self.layer_idx = placement, layer_idx
        self.length, self.key_buffer, self.value_buffer = 0, None, None

    def _reserve(self, key_states: torch.Tensor, value_states: torch.Tensor, needed: int) -> None:
        if needed > self.placement.region.capacity:
            self.placement.grow(needed)  # rebinds every layer that holds entries
        if self.key_buffer is None:
            self._bind(self.placement.region)

    def _bind(self, region: KVRegion) -> None:
        pool = region.pool
        self.key_buffer = pool.keys[self.layer_idx][..., region.start : region.end, :]  # [1, kv, capacity, d]: a view
        self.value_buffer = pool.values[self.layer_idx][..., region.start : region.end, :]
        self._fill_to(self.length)

    def rebind(self, old: KVRegion) -> None:
        """Copy what this layer caches from `old` into its placement's region, and use that (a
        region grown in place holds it already)."""
        if self.key_buffer is None:
            return
        if self.placement.region.start == old.start:
            self._bind(self.placement.region)
            return
        kept_keys, kept_values = self.key_buffer[..., : self.length, :], self.value_buffer[..., : self.length, :]
        self._bind(self.placement.region)
        self.key_buffer[..., : self.length, :] = kept_keys
        self.value_buffer[..., : self.length, :] = kept_values

    def advance(self, count: int) -> None:
        """Count `count` entries a packed forward wrote straight into the pool after this layer's."""
        region = self.placement.region
        if not self.is_initialized:
            pool = region.pool
            self.lazy_initialization(pool.keys[self.layer_idx][..., :0, :], pool.values[self.layer_idx][..., :0, :])
        if self.key_buffer is None:
            self._bind(region)
        self._fill_to(self.length + count)

    def reset(self) -> None:
        """Forget every entry; the range stays this layer's (nothing is zeroed: entries past the
        length are never read unmasked)."""
        self.length = 0
        if self.key_buffer is not None:
            self._fill_to(0)


class PooledKVCache(DynamicCache):
    """A session's cache in a KV pool: DynamicCache semantics (full attention, croppable) with
    every layer a PooledLayer in `region`."""

    def __init__(self, region: KVRegion):
        placement = _Placement(region)
        layers = [PooledLayer(placement, i) for i in range(len(region.pool.keys))]
        placement.layers = [weakref.ref(layer) for layer in layers]
        Cache.__init__(self, layers=layers)  # DynamicCache's own would make plain layers
        self.placement = placement

    @property
    def region(self) -> KVRegion:
        return self.placement.region

    def capacity_tokens(self) -> int:
        return self.placement.region.capacity

    def ensure_room(self, tokens: int) -> None:
        """Room for `tokens` in all, moving every layer first if the range holds fewer."""
        if tokens > self.placement.region.capacity:
            self.placement.grow(tokens)


def _blocks(tokens: int) -> int:
    """Whole blocks holding `tokens` (at least one)."""
    return max(1, -(-tokens // BLOCK_TOKENS))


def make_room(cache, new_tokens: int) -> None:
    """Room in a pooled cache for `new_tokens` more, moving it if need be (TooManySessions: the pool
    has none), before the forward it shares with others; other caches grow as they write."""
    if isinstance(cache, PooledKVCache):
        cache.ensure_room(cache.get_seq_length() + new_tokens)
