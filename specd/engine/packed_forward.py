"""One forward over several sessions' new tokens at once, each on its own KV cache.

A step of a small model on a CPU (or of any model on a GPU) is bound by reading the weights,
not by the arithmetic: eight sessions' tokens cost little more than one session's. So the
workers pack the new tokens of every session ready at the same moment into one sequence
[1, T] and run the model's own modules over it once (embedding, decoder layers, final norm,
output layer). Only attention differs: each session's queries attend to that session's own
cache, which grows in place (specd/engine/kv_cache.py), so no session's cache is copied and each
keeps its own rollback. The projections see one [1, T, H] input instead of several [1, L, H]
ones; the arithmetic per row is the same, the summation order of a matrix product may not
be, so a packed session's logits equal its lone forward's to rounding (greedy outputs differ
only at near-ties, the rule everywhere in specd).

Attention reaches the packed batch through transformers' attention interface: for the length
of a packed forward the model's config names the attention registered as "specd_packed", which
runs the model's own (sdpa or eager) once per session, or, where every session's cache is in the
worker's KV pool, one call over the pool (specd/engine/pooled_forward.py); a model's forwards all
run on its one model thread, so no other forward sees the switch, and plain forwards are untouched. A probe checks, before packing is
used, that a packed forward of three sessions gives their lone forwards' logits; a model it
does not fit (another layout, a recurrent or sliding-window layer) forwards one session at a
time, as before.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.models.llama.modeling_llama import eager_attention_forward

from specd.engine.backends.cpu_kernels.grouped_attention import GROUPED_SDPA, grouped_sdpa_attention
from specd.engine.backends.cpu_kernels.prepacked_linear import float32_products
from specd.engine.forward import elapsed_ms
from specd.engine.kv_cache import GrowingKVCache, croppable
from specd.engine.kv_pool import KVPool, PooledKVCache
from specd.engine.llama_layers import decoder_layers, run_layers
from specd.engine.pool_attention import MOST_QUERIES, PooledSegment, mask_inputs, padded
from specd.engine.pooled_forward import GRAPH_QUERIES, ForwardInputs, PooledForward

log = logging.getLogger(__name__)

_PACKED = "specd_packed"
_BASES = {"sdpa": sdpa_attention_forward, GROUPED_SDPA: grouped_sdpa_attention, "eager": eager_attention_forward}


@dataclasses.dataclass(frozen=True)
class Segment:
    """One session's part of a packed forward."""

    cache: object  # the session's DynamicCache; the forward appends this segment's entries
    tokens: list[int]  # fed after what `cache` holds
    num_logits: int  # logits wanted after the last `num_logits` tokens
    visible: torch.Tensor | None = None  # [L, cached + L] bool: which entries each token sees; None: causal
    positions: list[int] | None = None  # the tokens' positions; None: cached, cached + 1, ...
    # With `visible`: in each row, the entries it sees before this column are a run from the first
    # (a speculation tree's prefix); attention over the KV pool then needs a bitmap of the rest only.
    runs_before: int = 0


class _PackedBatch:
    """Stands in for the cache during one packed forward: each layer's new keys and values go
    to the segments' own caches; attention then reads each segment's full cache from here
    (specd/engine/pooled_forward.py's PoolBatch does when every cache is in the KV pool)."""

    def __init__(self, segments: list[Segment]):
        self.segments = segments
        ends = list(itertools.accumulate(len(s.tokens) for s in segments))
        self.bounds = list(zip([0] + ends[:-1], ends))  # each segment's slice of the packed sequence
        self.masks: list[torch.Tensor | None] = []  # [1, 1, L, cached + L] each, on the model's device (set by Packer)
        self.views: list[tuple[torch.Tensor, torch.Tensor]] = []  # the current layer's, per segment
        self.base_attention = "sdpa"  # the model's own attention (a key of _BASES), run per segment

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: [1, kv_heads, T, head_dim], packed."""
        self.views = [
            segment.cache.update(key_states[:, :, a:b], value_states[:, :, a:b], layer_idx)
            for segment, (a, b) in zip(self.segments, self.bounds)
        ]  # [1, kv_heads, cached + L, head_dim] each
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None) -> torch.Tensor:
        """The model's own attention once per segment: query [1, heads, T, head_dim] -> [1, T, heads, head_dim]."""
        base = _BASES[self.base_attention]
        outputs = []
        for (a, b), (keys, values), mask in zip(self.bounds, self.views, self.masks):
            if mask is not None and base is eager_attention_forward:
                mask = torch.zeros(mask.shape, dtype=query.dtype, device=query.device).masked_fill_(~mask, torch.finfo(query.dtype).min)
            output, _ = base(module, query[:, :, a:b], keys, values, mask, dropout=dropout, scaling=scaling)
            outputs.append(output)  # [1, L, heads, head_dim]
        return torch.cat(outputs, dim=1)


def _mask(segment: Segment, cached: int, device: torch.device) -> torch.Tensor | None:
    """[1, 1, L, cached + L] bool for sdpa, on `device`; None for one causal token (it sees everything)."""
    length = len(segment.tokens)
    if segment.visible is not None:
        return segment.visible.to(device).view(1, 1, length, cached + length)
    if length == 1:
        return None
    rows = torch.arange(length, device=device).unsqueeze(-1) + cached  # [L, 1]: each token's own index
    return (torch.arange(cached + length, device=device).unsqueeze(0) <= rows).view(1, 1, length, cached + length)


def _packed_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """A packed forward's attention, as the batch standing in for the cache does it (per segment,
    or over the KV pool). query: [1, heads, T, head_dim]; returns ([1, T, heads, head_dim], None)
    as transformers' attention functions do."""
    return kwargs[_PACKED].attend(module, query, key, value, attention_mask, dropout, scaling), None


AttentionInterface.register(_PACKED, _packed_attention)


class Packer:
    """Packed forwards for one model (see the module's docstring)."""

    def __init__(self, model, base_attention: str, pool: KVPool | None = None, graphs: bool = False):
        self.model = model
        self.base_attention = base_attention  # sdpa or eager: what the model's config names
        self.pool = pool  # the worker's KV pool, if its sessions' caches are in one
        self.pooled = False  # attend over the pool in one call when every segment's cache is in it (set once probed)
        self.over_pool = PooledForward(pool, self._logits, graphs) if pool is not None else None
        self._inner = model.model
        self._layers = decoder_layers(model)

    def forward(self, segments: list[Segment]) -> tuple[list[torch.Tensor], float]:
        """Every segment's logits ([num_logits, V] float32 each) and the forward's ms."""
        config = self.model.config
        config._attn_implementation_internal = _PACKED
        try:
            if self._fits_pool(segments):
                return self._forward_over_pool(segments)
            return self._forward(segments)
        finally:
            config._attn_implementation_internal = self.base_attention

    @torch.inference_mode()
    def _forward(self, segments: list[Segment]) -> tuple[list[torch.Tensor], float]:
        device = self.model.device
        batch = _PackedBatch(segments)
        batch.masks = [_mask(s, s.cache.get_seq_length(), device) for s in segments]
        batch.base_attention = self.base_attention
        started = time.perf_counter()
        ids = torch.tensor([[t for s in segments for t in s.tokens]], dtype=torch.long, device=device)  # [1, T]
        positions = torch.tensor([[p for s in segments for p in _positions(s)]], device=device)  # [1, T]
        logits = self._logits(ids, positions, batch, _logit_rows(segments, device))  # [sum of num_logits, V]
        return list(logits.split([s.num_logits for s in segments])), elapsed_ms(started, device)

    def _fits_pool(self, segments: list[Segment]) -> bool:
        """Whether the forward attends over the pool: every cache in it, and not too many queries."""
        if not self.pooled or padded(sum(len(s.tokens) for s in segments)) > MOST_QUERIES:
            return False
        return all(isinstance(s.cache, PooledKVCache) and s.cache.region.pool is self.pool for s in segments)

    @torch.inference_mode()
    def _forward_over_pool(self, segments: list[Segment]) -> tuple[list[torch.Tensor], float]:
        """The packed forward at its padded shape over the KV pool (specd/engine/pooled_forward.py);
        the caches count their new entries afterwards."""
        device = self.model.device
        started = time.perf_counter()
        mask = mask_inputs(_pooled_segments(segments), self.pool.spare_index, device)
        pad = mask.shape[0] - mask.tokens
        ids = torch.tensor([[t for s in segments for t in s.tokens] + [0] * pad], dtype=torch.long, device=device)  # [1, Q]
        positions = torch.tensor([[p for s in segments for p in _positions(s)] + [0] * pad], device=device)  # [1, Q]
        logits = self.over_pool.logits(ForwardInputs(ids, positions, mask), _logit_rows(segments, device))  # [sum of num_logits, V]
        for s in segments:
            for layer in s.cache.layers:
                layer.advance(len(s.tokens))
        return list(logits.split([s.num_logits for s in segments])), elapsed_ms(started, device)

    def _logits(self, ids: torch.Tensor, positions: torch.Tensor, batch, rows: torch.Tensor | None = None) -> torch.Tensor:
        """float32 logits [R, V] of `rows` (None: every one) of a forward of ids [1, Q] at `positions`
        [1, Q], `batch` standing in for the cache."""
        hidden = self._inner.embed_tokens(ids)  # [1, Q, H]
        hidden = run_layers(self.model, self._layers, hidden, positions, batch, **{_PACKED: batch})  # [1, Q, H]
        if rows is not None:
            hidden = hidden[:, rows]  # [1, R, H]
        return self.model.lm_head(self._inner.norm(hidden))[0].float()  # [R, V]


def _logit_rows(segments: list[Segment], device) -> torch.Tensor:
    """[sum of num_logits]: the packed rows whose logits the segments want, each its last ones."""
    ends = itertools.accumulate(len(s.tokens) for s in segments)
    return torch.tensor([i for end, s in zip(ends, segments) for i in range(end - s.num_logits, end)], device=device)


def _pooled_segments(segments: list[Segment]) -> list[PooledSegment]:
    """Each segment's place in the pool, its cache moved first where its range lacks room."""
    placed = []
    for s in segments:
        cached = s.cache.get_seq_length()
        s.cache.ensure_room(cached + len(s.tokens))
        placed.append(PooledSegment(s.cache.region.start, cached, len(s.tokens), s.visible, s.runs_before))
    return placed


def _positions(segment: Segment) -> list[int]:
    if segment.positions is not None:
        return list(segment.positions)
    cached = segment.cache.get_seq_length()
    return list(range(cached, cached + len(segment.tokens)))


def enable_packing(model, pool: KVPool | None = None, graphs: bool = False) -> Packer | None:
    """A Packer for `model` when its layout allows packing and the probe agrees; else None. With
    the worker's KV `pool`, it attends over the pool in one call where a second probe agrees, and
    with `graphs` (a GPU) replays such forwards as CUDA graphs."""
    config = getattr(model, "config", None)
    inner = getattr(model, "model", None)
    needed = ("embed_tokens", "layers", "rotary_emb", "norm")
    if config is None or inner is None or not all(hasattr(inner, n) for n in needed) or not hasattr(model, "lm_head"):
        return None
    base = config._attn_implementation
    if base not in _BASES or not full_attention_only(config):
        return None
    packer = Packer(model, base, pool, graphs)
    with float32_products(model):  # a draft's bfloat16 copies round 1-8-row products only
        agrees = _agrees(model, packer, GrowingKVCache)
        if agrees and pool is not None:
            packer.pooled = _pooled_agrees(model, packer)
        if packer.pooled and model.device.type == "cuda":
            _compile_steady_shapes(packer)
    if not agrees:
        log.warning("packed forwards do not fit %s here; its sessions forward one at a time", type(model).__name__)
        return None
    return packer


def graphs_fit(asked: bool, model) -> bool:
    """Whether forwards over the KV pool replay as CUDA graphs: asked, and the model is on a GPU."""
    return asked and model.device.type == "cuda"


def packing_fast_paths(packer: Packer | None, pool: KVPool | None) -> tuple[str, ...]:
    """What a worker reports of how its forwards pack and where its caches live."""
    pooled = packer is not None and packer.pooled
    taken = (
        ("packed_forward", packer is not None), ("kv_pool", pool is not None), ("pooled_attention", pooled),
        ("cuda_graphs", pooled and packer.over_pool.graphs),
    )
    return tuple(name for name, on in taken if on)


def _compile_steady_shapes(packer: Packer) -> None:
    """Forwards over the pool of every padded query count up to MOST_QUERIES that the pool has room
    for, so that serving does not wait for their kernels to compile; each of up to GRAPH_QUERIES
    twice, so that its graph is captured and its first replay with new inputs checked."""
    queries = 16
    while queries <= min(MOST_QUERIES, packer.pool.room // 2):
        tokens = queries * 3 // 4 + 1  # pads to `queries`
        for feed in range(2 if queries <= GRAPH_QUERIES else 1):
            cache = PooledKVCache(packer.pool.allocate(tokens))
            packer.forward([Segment(cache, [feed] * tokens, 1)])
        queries *= 2


def _pooled_agrees(model, packer: Packer) -> bool:
    """The probe again, with the packed sessions' caches in the pool and attention over it."""
    packer.pooled = True
    try:
        agrees = _agrees(model, packer, lambda: PooledKVCache(packer.pool.allocate(1)))
    except Exception:  # noqa: BLE001 - a kernel this torch or device lacks: attend per session instead
        log.warning("attention over the KV pool failed its probe", exc_info=True)
        agrees = False
    if not agrees:
        log.warning("attention over the KV pool does not fit %s here; packed forwards attend per session", type(model).__name__)
    return agrees


def _causal(cached: int, length: int, device) -> torch.Tensor:
    """[length, cached + length] bool: each new token sees the cache and the new tokens up to itself."""
    return torch.arange(cached + length, device=device)[None, :] <= torch.arange(length, device=device)[:, None] + cached


def full_attention_only(config) -> bool:
    """Every layer attends to the whole context, unscaled: what the per-session masks assume
    (a window shorter than the probe's sequences would pass the probe unnoticed)."""
    if getattr(config, "attn_logit_softcapping", None) or getattr(config, "final_logit_softcapping", None):
        return False
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None:
        return all(kind == "full_attention" for kind in layer_types)
    return not getattr(config, "sliding_window", None)


@torch.inference_mode()
def _agrees(model, packer: Packer, new_cache) -> bool:
    """Three sessions packed (a prefill, a multi-token step, one token; the last with its causal
    mask given, as a tree's step gives its own) against their lone forwards. `new_cache()`: a
    packed session's cache."""
    vocab = model.config.vocab_size
    generator = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (5, 9, 3)]
    steps = [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in (3, 1, 4)]
    lone, packed = [GrowingKVCache() for _ in prompts], [new_cache() for _ in prompts]
    for feeds in (prompts, steps):
        want = [
            model(input_ids=torch.tensor([f], device=model.device), past_key_values=c, use_cache=True).logits[0].float().cpu()
            for f, c in zip(feeds, lone)
        ]  # [n, V] each
        segments = [Segment(c, f, len(f)) for f, c in zip(feeds[:2], packed)]
        cached = packed[2].get_seq_length()
        segments.append(Segment(packed[2], feeds[2], len(feeds[2]), visible=_causal(cached, len(feeds[2]), model.device)))
        got, _ = packer.forward(segments)
        got = [g.cpu() for g in got]  # [n, V] each
        if not all(croppable(c) for c in packed):
            return False
        if not all(_close(w, g, model.dtype) for w, g in zip(want, got)):
            return False
    return True


def _close(want: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> bool:
    """The same logits [n, V] to rounding. In float32 within 1e-4. A bfloat16 or float16 model
    rounds every layer's output, and two forwards that round in other places differ: each row by
    up to 6 units of the dtype's last place, relative to the row's norm. On the default target in
    bfloat16, rounding alone (positions shifted by one, which rotary attention cannot see) moved a
    row by at most 0.018 of its norm, one wrongly visible token by up to 0.095."""
    if dtype == torch.float32:
        return torch.allclose(want, got, rtol=1e-4, atol=1e-4)
    rows = (want - got).norm(dim=-1) / want.norm(dim=-1).clamp(min=1e-6)  # [n]
    return bool(rows.max() <= 6 * torch.finfo(dtype).eps)
