"""Packed forwards over the KV pool at padded, static shapes; on a GPU, replayed as CUDA graphs.

When every session of a forward keeps its cache in the worker's KV pool (specd/engine/kv_pool.py),
the whole forward has the shape of its padded query count Q and bitmap width C
(specd/engine/pool_attention.py): the tokens [1, Q] (padding queries see nothing and write to the
pool's spare entry), one index_copy_ of the new keys and values per layer, one FlexAttention
call per layer over the pool, and the logits of all Q rows. Nothing in it depends on the host but
its input tensors, so on a GPU the first forward of a shape of up to GRAPH_QUERIES queries is
captured as a CUDA graph and later ones replay it with their inputs copied in: an eager step of a
large model on a GPU is bound by launching its kernels, a replay launches one graph. A graph is
checked against the eager forward it stands for twice: replaying its capture's own inputs, and at
its first replay with another forward's; one that differs, or a capture that fails, turns graphs
off for the worker and it forwards eagerly.

The caches' lengths are counted on the host after the forward (a replay runs no Python).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Callable

import torch

from specd.engine.kv_pool import KVPool
from specd.engine.pool_attention import MaskInputs, block_mask, pooled_attention

log = logging.getLogger(__name__)

GRAPH_QUERIES = 128  # larger forwards (prompts) are bound by their arithmetic, not by launches

# (ids [1, Q], positions [1, Q], the batch standing in for the cache, rows [R] or None for all)
# -> logits [R, V] float32
RunModel = Callable[[torch.Tensor, torch.Tensor, "PoolBatch", torch.Tensor | None], torch.Tensor]


class PoolBatch:
    """Stands in for the cache in a forward over the pool: each layer's new entries go into the
    pool at the forward's write indices; attention reads the pool's layer in one call."""

    def __init__(self, pool: KVPool, inputs: MaskInputs):
        self.pool = pool
        self.write_index = inputs.write_index  # [Q]
        self.block_mask = block_mask(inputs, pool.tokens)
        self.layer_idx = 0  # the layer whose keys and values were written last

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        """key_states, value_states: [1, kv_heads, Q, head_dim]."""
        self.layer_idx = layer_idx
        self.pool.keys[layer_idx].index_copy_(2, self.write_index, key_states)  # into [1, kv_heads, N, head_dim]
        self.pool.values[layer_idx].index_copy_(2, self.write_index, value_states)
        return key_states, value_states

    def attend(self, module, query, key, value, attention_mask, dropout=0.0, scaling=None) -> torch.Tensor:
        """query [1, heads, Q, head_dim] -> [1, Q, heads, head_dim]."""
        layer = self.layer_idx
        return pooled_attention(query, self.pool.keys[layer], self.pool.values[layer], self.block_mask, scaling)


@dataclasses.dataclass(frozen=True)
class ForwardInputs:
    """Everything a forward over the pool reads: a CUDA graph's inputs, refilled for each replay."""

    ids: torch.Tensor  # [1, Q] int64
    positions: torch.Tensor  # [1, Q] int64
    mask: MaskInputs

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.ids, self.positions, *self.mask.tensors())


@dataclasses.dataclass
class _Graph:
    graph: "torch.cuda.CUDAGraph"
    inputs: ForwardInputs  # the tensors it was captured reading
    logits: torch.Tensor  # [Q, V]: what it writes
    replayed: bool = False  # replayed with refilled inputs (the first such replay is checked)


class PooledForward:
    """Forwards over `pool` through `run_model`; with `graphs` (a GPU), small ones as CUDA graphs."""

    def __init__(self, pool: KVPool, run_model: RunModel, graphs: bool):
        self.pool = pool
        self.run_model = run_model
        self.graphs = graphs
        self._captured: dict[tuple[int, int], _Graph] = {}
        self._memory = None  # the graphs' shared memory pool, made at the first capture

    def logits(self, inputs: ForwardInputs, rows: torch.Tensor) -> torch.Tensor:
        """[R, V] float32: the logits of the queries `rows` [R], eagerly or through the graph of
        the forward's shape (which makes every query's: a graph's rows are fixed)."""
        if not self.graphs or inputs.ids.shape[1] > GRAPH_QUERIES:
            return self._run(inputs, rows)
        captured = self._captured.get(inputs.mask.shape)
        if captured is None:
            return self._capture(inputs)[rows]
        for static, fresh in zip(captured.inputs.tensors(), inputs.tensors()):
            static.copy_(fresh)
        captured.graph.replay()
        if not captured.replayed:
            captured.replayed = True
            eager = self._run(inputs)  # the same entries written again
            if not self._agree(captured.logits, eager, "a replay with new inputs"):
                return eager[rows]
        return captured.logits[rows]  # a copy: the next replay overwrites the graph's own

    def _agree(self, replayed: torch.Tensor, eager: torch.Tensor, what: str) -> bool:
        """Whether a graph's logits are the eager forward's; if not, graphs go off for good."""
        if torch.allclose(replayed, eager, rtol=1e-3, atol=1e-3):
            return True
        log.warning("CUDA graphs of forwards over the KV pool are off: %s differs from its eager forward by %.3g",
                    what, (replayed - eager).abs().max().item())
        self._turn_off()
        return False

    def _turn_off(self) -> None:
        self.graphs = False
        self._captured.clear()  # their outputs and memory go
        self._memory = None

    def _run(self, inputs: ForwardInputs, rows: torch.Tensor | None = None) -> torch.Tensor:
        return self.run_model(inputs.ids, inputs.positions, PoolBatch(self.pool, inputs.mask), rows)

    def _capture(self, inputs: ForwardInputs) -> torch.Tensor:
        """This forward, run eagerly, and captured as the graph of its shape (the captured graph
        keeps `inputs` as its own). Any failure turns graphs off: the eager result stands."""
        own = torch.cuda.current_stream()
        stream = torch.cuda.Stream()
        stream.wait_stream(own)
        with torch.cuda.stream(stream):  # compiles this shape's kernels before the capture
            eager = self._run(inputs)
        own.wait_stream(stream)
        try:
            self._memory = self._memory if self._memory is not None else torch.cuda.graph_pool_handle()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._memory):
                logits = self._run(inputs)
            graph.replay()  # the same forward again: it writes the same entries
        except Exception:  # noqa: BLE001 - a kernel or a library call that cannot be captured: forward eagerly
            torch.cuda.set_stream(own)  # a capture that failed to end leaves its own stream current
            log.warning("CUDA graphs of forwards over the KV pool are off", exc_info=True)
            self._turn_off()
            return eager
        if not self._agree(logits, eager, "a capture's replay"):
            return eager
        self._captured[inputs.mask.shape] = _Graph(graph, inputs, logits)
        log.info("captured a CUDA graph of forwards over the KV pool for %d queries, bitmap %d wide", *inputs.mask.shape)
        return eager
