"""A packed forward's attention over the KV pool: one FlexAttention call per layer for every session.

When each session of a packed forward keeps its cache in one KV pool (specd/engine/kv_pool.py),
every query of the packed sequence attends over the same keys and values, the pool's layer
[1, kv_heads, N, head_dim]; what a query may see is a mask: its own session's range, causally,
or, for a segment that brings its own visibility (a speculation tree's step), that bitmap over
the segment's entries. FlexAttention takes the mask as a block mask, so a query block reads only
the blocks its sessions' ranges cover, and the call replaces the loop of one attention per session.

The block mask comes from each query's ranges in a few tensor operations on the model's device
(no read-back). On a GPU FlexAttention is compiled (its eager form materializes every score);
query counts and bitmap widths are padded to powers of two so that the compiled kernels (and the
CUDA graphs of specd/engine/pooled_forward.py) are few.
"""

from __future__ import annotations

import dataclasses
import functools
import warnings

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from specd.engine.kv_pool import BLOCK_TOKENS

_MOST_KERNELS = 64
# Past this many (a long prompt's catch-up), a forward attends per session: the compiled kernels
# stay few and the [queries, pool blocks] temporaries of its block mask small.
MOST_QUERIES = 4096


@dataclasses.dataclass(frozen=True)
class PooledSegment:
    """What the mask needs of one session's part of a packed forward."""

    start: int  # the pool index of the session cache's first entry
    cached: int  # entries the cache holds before this forward
    length: int  # tokens this forward feeds (written at start + cached, ...)
    visible: torch.Tensor | None = None  # [length, cached + length] bool, on the device; None: causal
    runs_before: int = 0  # with `visible`: before this column, what each row sees is a run from the first


@dataclasses.dataclass(frozen=True)
class MaskInputs:
    """One packed forward's placement in the pool, at its padded query count Q: what its block
    mask is made from (block_mask below) and where its new entries go. Query q sees pool entries
    [lo, hi), and those of [window, window + width) whose bit is set in its bitmap row; a padding
    query sees nothing and writes to the pool's spare entry."""

    lo: torch.Tensor  # [Q] int64
    hi: torch.Tensor  # [Q] int64
    window: torch.Tensor  # [Q] int64
    width: torch.Tensor  # [Q] int64
    bitmap: torch.Tensor  # [Q, C] bool
    write_index: torch.Tensor  # [Q] int64: the pool index of each query's new key and value
    tokens: int  # the packed tokens, before padding

    @property
    def shape(self) -> tuple[int, int]:
        """(Q, C): with the pool's size, what a compiled kernel or a CUDA graph is made for."""
        return tuple(self.bitmap.shape)

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return self.lo, self.hi, self.window, self.width, self.bitmap, self.write_index


def padded(count: int) -> int:
    """The length a count of queries or bitmap columns is padded to: a power of two, at least 16."""
    return max(16, 1 << (count - 1).bit_length())


def mask_inputs(segments: list[PooledSegment], spare_index: int, device: torch.device) -> MaskInputs:
    """The placement of a packed forward whose segments are `segments`, in order; padding queries
    write to `spare_index`, a pool entry no session holds."""
    tokens = sum(s.length for s in segments)
    queries = padded(tokens)
    splits = _split_visibility(segments)
    rows = {"lo": [], "hi": [], "window": [], "width": [], "write": []}
    for s, split in zip(segments, splits):
        first_new = s.start + s.cached
        rows["lo"] += [s.start] * s.length
        rows["hi"] += [first_new + i + 1 for i in range(s.length)] if split is None else [s.start] * s.length
        rows["window"] += [s.start + (split[1] if split else 0)] * s.length
        rows["width"] += [s.cached + s.length - split[1] if split else 0] * s.length
        rows["write"] += range(first_new, first_new + s.length)
    pad = queries - tokens
    rows["write"] += [spare_index] * pad
    lo, hi, window, width, write_index = torch.tensor(
        [rows[k] + [0] * pad for k in ("lo", "hi", "window", "width")] + [rows["write"]], dtype=torch.int64, device=device
    )  # [Q] each
    bitmap = torch.zeros(queries, padded(max(rows["width"], default=1)), dtype=torch.bool, device=device)  # [Q, C]
    row = 0
    for s, split in zip(segments, splits):
        if split is not None:
            lead, tail = split
            hi[row : row + s.length] = lead + s.start  # each row's leading run of visible entries
            bitmap[row : row + s.length, : s.cached + s.length - tail] = s.visible[:, tail:].to(device)  # [L, cached + L - tail]
        row += s.length
    return MaskInputs(lo, hi, window, width, bitmap, write_index, tokens)


def block_mask(inputs: MaskInputs, pool_tokens: int) -> BlockMask:
    """The block mask of `inputs` over a pool of `pool_tokens`, made on the device from its tensors
    alone (so that a CUDA graph can make it again from the same tensors, refilled)."""
    lo, hi, window, width, bitmap = inputs.lo, inputs.hi, inputs.window, inputs.width, inputs.bitmap
    columns = bitmap.shape[1]

    def mask_mod(b, h, q, k):
        offset = k - window[q]
        in_window = (offset >= 0) & (offset < width[q])
        return ((k >= lo[q]) & (k < hi[q])) | (in_window & bitmap[q, offset.clamp(0, columns - 1)])

    kv_num_blocks, kv_indices = _touched_blocks(lo, hi, window, width, pool_tokens)
    return BlockMask.from_kv_blocks(
        kv_num_blocks, kv_indices, BLOCK_SIZE=BLOCK_TOKENS, mask_mod=mask_mod, seq_lengths=(bitmap.shape[0], pool_tokens)
    )


def _split_visibility(segments: list[PooledSegment]) -> list[tuple[torch.Tensor, int] | None]:
    """For each segment with its own visibility, ([L] each row's leading run of visible entries,
    on the device; the column its bitmap starts at); None for a causal one.

    A speculation tree's row sees a prefix of the context, then its branch's entries at the end:
    the runs go to the [lo, hi) ranges and only the end needs a bitmap, a few blocks wide however
    long the context (its width is a compiled kernel's shape)."""
    splits = []
    for s in segments:
        if s.visible is None:
            splits.append(None)
            continue
        lead = s.visible.to(torch.int32).cumprod(dim=1).sum(dim=1)  # [L]
        splits.append((lead, min(s.runs_before, s.cached + s.length)))
    return splits


def _touched_blocks(lo, hi, window, width, pool_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each block of queries, the pool blocks any of its queries may see: ([1, 1, QB] int32
    counts, [1, 1, QB, NB] int32 block indices, those seen first)."""
    device = lo.device
    block_start = torch.arange(0, pool_tokens, BLOCK_TOKENS, device=device)  # [NB]
    block_end = block_start + BLOCK_TOKENS
    in_range = (block_end > lo[:, None]) & (block_start < hi[:, None])  # [queries, NB]
    in_window = (width[:, None] > 0) & (block_end > window[:, None]) & (block_start < (window + width)[:, None])
    seen = in_range | in_window  # [queries, NB]
    query_blocks = -(-seen.shape[0] // BLOCK_TOKENS)
    seen = F.pad(seen, (0, 0, 0, query_blocks * BLOCK_TOKENS - seen.shape[0]))  # [QB * BLOCK, NB]
    seen = seen.view(query_blocks, BLOCK_TOKENS, -1).any(dim=1)  # [QB, NB]
    counts = seen.sum(dim=-1, dtype=torch.int32)  # [QB]
    order = torch.argsort((~seen).to(torch.int8), dim=-1, stable=True).to(torch.int32)  # [QB, NB]: seen blocks first
    return counts[None, None], order[None, None]


def pooled_attention(query, keys, values, mask: BlockMask, scaling: float | None) -> torch.Tensor:
    """query [1, heads, Q, head_dim] over the pool's keys and values [1, kv_heads, N, head_dim];
    returns [1, Q, heads, head_dim], as transformers' attention functions do."""
    attend = _compiled_flex() if query.device.type == "cuda" else _eager_flex
    output = attend(query, keys, values, block_mask=mask, scale=scaling, enable_gqa=query.shape[1] != keys.shape[1])  # [1, heads, Q, head_dim]
    return output.transpose(1, 2)


@functools.cache
def _compiled_flex():
    # One kernel per (padded query count, bitmap width): a few tens over a server's life, more than
    # dynamo's default of 8 recompiles per function, past which it would run the eager form.
    config = torch._dynamo.config
    if hasattr(config, "recompile_limit"):
        config.recompile_limit = max(config.recompile_limit, _MOST_KERNELS)
    return torch.compile(flex_attention, dynamic=False)


def _eager_flex(*args, **kwargs):
    """FlexAttention's reference form (every score materialized): for the CPU, where the pool is
    only asked for by hand and kept small."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="flex_attention called without torch.compile")
        return flex_attention(*args, **kwargs)
