"""The KV pool: sessions' caches as ranges of one tensor per layer, and packed forwards that
attend over it in one call per layer.

Its ranges (whole blocks, first fit, merged when returned, returned only when nothing holds the
cache); a pooled cache's lone forwards against a growing cache's, bitwise, through rollbacks and a
move past its range; packed forwards over the pool against lone forwards (ragged lengths,
rollbacks, a tree segment, queries padded past a block); the session store admitting by ranges;
and a served stack whose workers keep their caches in pools and decode what the target alone does.
"""

from __future__ import annotations

import concurrent.futures

import pytest
import torch

from specd.core.errors import NO_SESSION_ROOM, TooManySessions
from specd.engine.kv_cache import GrowingKVCache
from specd.engine.kv_pool import BLOCK_TOKENS, KVPool, PooledKVCache
from specd.engine.packed_forward import Segment, enable_packing
from specd.engine.session_cache import SessionStore
from tests.conftest import CALL_TIMEOUT_S, assert_greedy_equal_or_near_tie, request, running_stack
from tests.engine.test_batching import TOLERANCE, _lone, check_packed_steps
from tests.tiny_models import build_llama


@pytest.fixture(scope="module")
def model():
    return build_llama(384, seed=3).eval()


def _pool(model, tokens: int = 16 * BLOCK_TOKENS) -> KVPool:
    return KVPool.for_model(model, tokens)


def test_ranges_are_whole_blocks_first_fit_and_merge_when_returned(model):
    pool = _pool(model, 5 * BLOCK_TOKENS + 5)
    assert pool.keys[0].shape == (1, 2, 5 * BLOCK_TOKENS, 16)
    assert pool.room == 4 * BLOCK_TOKENS and pool.spare_index == 5 * BLOCK_TOKENS - 1  # the last block is no session's
    a, b, c = pool.allocate(1), pool.allocate(BLOCK_TOKENS + 1), pool.allocate(BLOCK_TOKENS)
    assert [(r.start, r.capacity) for r in (a, b, c)] == [(0, 128), (128, 256), (384, 128)]
    assert pool.used_tokens() == 4 * BLOCK_TOKENS
    with pytest.raises(TooManySessions) as refused:
        pool.allocate(1)
    assert str(refused.value).startswith(NO_SESSION_ROOM)
    del a, c  # two single blocks free, apart: no room for two blocks
    with pytest.raises(TooManySessions):
        pool.allocate(2 * BLOCK_TOKENS)
    del b  # all three merge into one range
    assert pool.used_tokens() == 0
    assert pool.allocate(4 * BLOCK_TOKENS).start == 0


def test_a_range_stays_taken_while_anything_holds_its_cache(model):
    """A job under way holds its session's cache after EndSession: its range is not handed out."""
    pool = _pool(model, 3 * BLOCK_TOKENS)
    store = SessionStore(4, 60.0, pool=pool)
    held = store.open("ended", 0, 2 * BLOCK_TOKENS).cache
    store.end("ended")
    with pytest.raises(TooManySessions):
        store.open("next", 0, BLOCK_TOKENS)
    del held
    assert store.open("next", 0, BLOCK_TOKENS).cache.region.start == 0
    assert store.held_bytes() == BLOCK_TOKENS * pool.bytes_per_token


def test_a_session_that_outgrew_its_range_keeps_only_the_new_one_and_resets_into_it(model):
    pool = _pool(model)
    store = SessionStore(4, 60.0, pool=pool)
    session = store.open("s", 0, BLOCK_TOKENS)
    blocker = pool.allocate(BLOCK_TOKENS)  # right after the session's range: it cannot grow in place
    _lone(model, session.cache, list(range(1, 200)))  # past its first range: the cache moves
    moved = session.cache.region
    assert moved.start == 2 * BLOCK_TOKENS
    assert pool.used_tokens() == moved.capacity + BLOCK_TOKENS == 5 * BLOCK_TOKENS  # the first range went back
    session.reset()  # a forward failed part-way
    assert session.cache.region is moved and session.cache.get_seq_length() == 0
    del blocker
    assert store.held_bytes() == moved.capacity * pool.bytes_per_token


def test_a_pooled_cache_forwards_bitwise_as_a_growing_one_through_rollbacks_a_move_and_growth_in_place(model):
    pool = _pool(model)
    first = pool.allocate(BLOCK_TOKENS)  # the cache's range is not the pool's first
    growing, pooled = GrowingKVCache(), PooledKVCache(pool.allocate(BLOCK_TOKENS))
    after = pool.allocate(BLOCK_TOKENS)  # nor can it grow in place at first
    generator = torch.Generator().manual_seed(4)
    for length in (20, 3, 1, 150, 2, 250):  # the fourth feed passes the first range: every layer moves
        tokens = torch.randint(0, 384, (length,), generator=generator).tolist()
        assert torch.equal(_lone(model, growing, tokens), _lone(model, pooled, tokens))
        growing.crop(-1)
        pooled.crop(-1)
        if length == 150:
            moved = pooled.region
            assert moved.start == 3 * BLOCK_TOKENS and moved.capacity >= 2 * 173
            del first, after  # the sixth feed passes the moved range: it grows over the free blocks after it
    assert pooled.region.start == moved.start and pooled.capacity_tokens() >= 2 * 425
    assert pooled.get_seq_length() == growing.get_seq_length() == 420
    assert pool.used_tokens() == pooled.capacity_tokens()  # the range before the growth returns with it


def test_packed_forwards_over_the_pool_get_lone_logits_through_steps_rollbacks_and_moves(model):
    pool = _pool(model)
    packer = enable_packing(model, pool)
    assert packer.pooled
    # A block each; the last grows in place over the free blocks after it at step 0, the third,
    # with no free block after it then, moves at step 1.
    lengths = [[17, 3, 1, 5], [4, 1, 9, 1], [30, 140, 2, 2], [140, 1, 1, 7]]
    pooled = [PooledKVCache(pool.allocate(32)) for _ in lengths]
    check_packed_steps(model, packer, lengths, pooled)
    assert [(c.region.start, c.capacity_tokens()) for c in pooled[2:]] == [(6 * BLOCK_TOKENS, 384), (3 * BLOCK_TOKENS, 384)]


def test_a_tree_segment_over_the_pool_sees_only_its_branch(model):
    pool = _pool(model)
    packer = enable_packing(model, pool)
    assert packer.pooled
    prompt = list(range(10, 22))
    lone, pooled, other = GrowingKVCache(), PooledKVCache(pool.allocate(64)), PooledKVCache(pool.allocate(64))
    _lone(model, lone, prompt)
    packer.forward([Segment(pooled, prompt, 1), Segment(other, [5, 6, 7], 1)])
    cached = len(prompt)
    visible = torch.zeros(3, cached + 3, dtype=torch.bool)  # two branches, then a child of the first
    visible[:, :cached] = True
    visible[1, cached - 2 :] = False  # the second branch roots two tokens earlier, as a tree's may
    visible[0, cached] = visible[1, cached + 1] = visible[2, cached] = visible[2, cached + 2] = True
    positions = [cached, cached - 2, cached + 1]
    want = _lone(model, lone, [40, 41, 42], visible, positions)
    for runs_before in (0, cached):  # a bitmap of every column; of the branches' only, as a tree's step says
        got, _ = packer.forward([Segment(other, [9], 1), Segment(pooled, [40, 41, 42], 3, visible, positions, runs_before)])
        assert torch.allclose(want, got[1], rtol=TOLERANCE, atol=TOLERANCE)
        pooled.crop(-3)
        other.crop(-1)


def test_a_packed_prompt_longer_than_a_block_of_queries(model):
    """Queries past the first block of 128, padded to a power of two: each sees its own session."""
    pool = _pool(model)
    packer = enable_packing(model, pool)
    assert packer.pooled
    prompts = [list(range(1, 200)), list(range(50, 90))]
    lone = [GrowingKVCache() for _ in prompts]
    pooled = [PooledKVCache(pool.allocate(256)) for _ in prompts]
    want = [_lone(model, cache, prompt) for cache, prompt in zip(lone, prompts)]
    got, _ = packer.forward([Segment(cache, prompt, len(prompt)) for cache, prompt in zip(pooled, prompts)])
    for w, g in zip(want, got):
        assert torch.allclose(w, g, rtol=TOLERANCE, atol=TOLERANCE)


def test_a_served_stack_with_pools_decodes_as_the_target_alone(tiny_pair):
    from specd.v1 import coordinator_pb2 as pb
    from tests.conftest import greedy_reference, load_reference
    from tests.observability.test_metrics import scrape

    model, _ = load_reference(tiny_pair[0])
    prompts = [[5 + i, 17, 42 + i, 99, 7, 3 + 2 * i][: 3 + i % 4] for i in range(6)]
    pooled = {"metrics_port": 0, "kv_pool": "on", "kv_cache_bytes": 1 << 22}
    unlimited = {"speculation_max_running": 0}  # speculate at any load: batched trees are the point
    with running_stack(*tiny_pair, target_overrides=pooled, draft_overrides=pooled, coordinator_overrides=unlimited) as stack:
        target_runner = stack.target.servicer.runner
        assert "pooled_attention" in target_runner.fast_paths
        stub = stack.stub()
        with concurrent.futures.ThreadPoolExecutor(len(prompts)) as threads:
            responses = list(threads.map(
                lambda p: stub.Generate(request(p, mode=pb.SPECULATION_MODE_SSD, max_new_tokens=20), timeout=CALL_TIMEOUT_S), prompts
            ))
        target = scrape(stack.target.metrics.port)
    for prompt, response in zip(prompts, responses):
        assert_greedy_equal_or_near_tie(model, prompt, list(response.token_ids), greedy_reference(model, prompt, 20))
    op = (("op", "verify"), ("role", "target"))
    assert target[("specd_forward_batch_size_sum", op)] > target[("specd_forward_batch_size_count", op)]


def test_a_pool_mask_lists_every_block_its_queries_see_and_no_other_session_s():
    """A compiled FlexAttention reads only the blocks the mask lists (the eager form, which the
    CPU runs, reads all): each visible entry lies in a listed block, and a block of queries lists
    only blocks within the ranges of the sessions it holds queries of."""
    from torch.nn.attention.flex_attention import create_mask

    from specd.engine.pool_attention import PooledSegment, block_mask, mask_inputs

    tree = torch.zeros(2, 102, dtype=torch.bool)  # two branches after a prefix of 100
    tree[0, :100] = tree[1, :98] = True
    tree[0, 100] = tree[1, 101] = True
    segments = [  # (range start, range end) beside each
        (PooledSegment(0, 150, 3), (0, 256)),
        (PooledSegment(384, 100, 2, tree, runs_before=100), (384, 512)),
        (PooledSegment(1024, 0, 130), (1024, 1280)),
    ]
    pool_tokens = 12 * BLOCK_TOKENS
    inputs = mask_inputs([s for s, _ in segments], pool_tokens - 1, torch.device("cpu"))
    mask = block_mask(inputs, pool_tokens)
    queries = mask.shape[-2]
    assert queries == 256 and inputs.tokens == 135
    assert inputs.shape == (256, 16)  # the branches' two columns, not the prefix's hundred
    assert inputs.write_index.tolist() == [150, 151, 152, 484, 485, *range(1024, 1154)] + [pool_tokens - 1] * 121
    visible = create_mask(mask.mask_mod, 1, 1, queries, pool_tokens, "cpu")[0, 0]  # [256, N]
    assert not visible[135:].any()  # padding queries see nothing
    listed = mask.to_dense()[0, 0].bool()  # [QB, NB]
    listed = listed.repeat_interleave(BLOCK_TOKENS, 0).repeat_interleave(BLOCK_TOKENS, 1)  # [256, N]
    assert not (visible & ~listed).any()
    owner = torch.tensor([i for i, (s, _) in enumerate(segments) for _ in range(s.length)] + [-1] * (queries - 135))
    for block in range(queries // BLOCK_TOKENS):
        rows = slice(block * BLOCK_TOKENS, (block + 1) * BLOCK_TOKENS)
        allowed = torch.zeros(pool_tokens, dtype=torch.bool)
        for i in set(owner[rows].tolist()) - {-1}:
            allowed[segments[i][1][0] : segments[i][1][1]] = True
        assert not (listed[block * BLOCK_TOKENS] & ~allowed).any(), f"query block {block} lists another session's blocks"
    assert visible[0, :151].all() and not visible[0, 151:].any()  # causal in its own range
    assert visible[3, 384:485].all() and not visible[3, 485:].any() and not visible[3, :384].any()  # its branch only
    assert visible[4, 384:482].all() and not visible[4, 482:485].any() and visible[4, 485] and not visible[4, 486:].any()


def test_kv_pool_is_on_where_asked_and_fits_and_auto_keeps_a_cpu_without_one(model):
    import dataclasses

    from specd.core.config import ConfigError
    from specd.core.sampling import SamplingSettings
    from specd.engine.kv_budget import kv_bytes_per_token
    from specd.engine.loading import LoadedModel
    from specd.worker.config import WorkerConfig
    from specd.worker.sessions import session_store

    per_token = kv_bytes_per_token(model)
    loaded = LoadedModel("m", model, None, 384, 2048, (), SamplingSettings(), "", "float32", "cpu")
    config = WorkerConfig(model="m", kv_cache_bytes=1000 * per_token)
    assert session_store(config, loaded)[0].pool is None  # auto: a CPU keeps attention per session
    store, served = session_store(dataclasses.replace(config, kv_pool="on"), loaded)
    assert store.pool.room == 6 * BLOCK_TOKENS and served.context_length == 6 * BLOCK_TOKENS  # 1000 tokens: 7 blocks, 1 spare
    assert session_store(dataclasses.replace(config, kv_pool="off"), loaded)[0].pool is None
    refusals = {
        "--kv-cache-bytes": dataclasses.replace(config, kv_pool="on", kv_cache_bytes=0),
        "at least 256": dataclasses.replace(config, kv_pool="on", kv_cache_bytes=200 * per_token),
    }
    for message, refused in refusals.items():
        with pytest.raises(ConfigError, match=message):
            session_store(refused, loaded)
    with pytest.raises(ConfigError, match="tensor parallelism"):
        session_store(dataclasses.replace(config, kv_pool="on"), loaded, shards=2)


def test_a_range_returned_while_its_pool_is_locked_does_not_wait_for_the_lock(model):
    """A collection may start, and free a cache, on a thread that holds the pool's lock (inside
    allocate): the range comes back at the next allocation instead of deadlocking that thread."""
    import threading

    pool = _pool(model, 3 * BLOCK_TOKENS)
    region = [pool.allocate(2 * BLOCK_TOKENS)]

    def free_inside_the_lock():
        with pool._lock:
            region.clear()  # the region's finalizer runs here

    thread = threading.Thread(target=free_inside_the_lock, daemon=True)
    thread.start()
    thread.join(5)
    assert not thread.is_alive()
    assert pool.allocate(2 * BLOCK_TOKENS).start == 0


def test_a_cache_that_outgrows_its_range_takes_what_fits_when_twice_does_not(model):
    from specd.engine.kv_pool import make_room

    pool = _pool(model, 6 * BLOCK_TOKENS)  # room for 5 blocks
    cache = PooledKVCache(pool.allocate(1))
    make_room(cache, 2 * BLOCK_TOKENS)  # twice is 4 blocks, free after its own: it grows in place
    assert (cache.region.start, cache.capacity_tokens()) == (0, 4 * BLOCK_TOKENS)
    make_room(cache, 5 * BLOCK_TOKENS)  # twice is 10 blocks; the one after its own takes the rest
    assert (cache.region.start, cache.capacity_tokens()) == (0, 5 * BLOCK_TOKENS)
    with pytest.raises(TooManySessions):
        make_room(cache, 5 * BLOCK_TOKENS + 1)

    del cache
    before, cache = pool.allocate(1), PooledKVCache(pool.allocate(1))
    after = pool.allocate(1)  # nothing free right after the cache: it moves, to what fits
    make_room(cache, 2 * BLOCK_TOKENS - 1)  # twice is 4 blocks, only 2 are free in one range
    assert (cache.region.start, cache.capacity_tokens()) == (3 * BLOCK_TOKENS, 2 * BLOCK_TOKENS)
    make_room(GrowingKVCache(), 10**6)  # a cache of its own grows as it writes
    del before, after


def test_a_range_is_cleared_when_handed_out(model):
    """A session's blocks are read whole and masked afterwards: a value a previous session left
    there must not reach it (a zero weight keeps a NaN)."""
    pool = _pool(model, 4 * BLOCK_TOKENS)
    region = pool.allocate(BLOCK_TOKENS)
    for keys, values in zip(pool.keys, pool.values):
        keys.fill_(float("nan"))
        values.fill_(float("nan"))
    del region
    cache = PooledKVCache(pool.allocate(BLOCK_TOKENS))
    cache.ensure_room(2 * BLOCK_TOKENS)  # grows in place over a block the previous session also left
    assert cache.region.start == 0
    for keys, values in zip(pool.keys, pool.values):
        assert not keys[..., : 2 * BLOCK_TOKENS, :].isnan().any() and not values[..., : 2 * BLOCK_TOKENS, :].isnan().any()
    assert values[..., 2 * BLOCK_TOKENS :, :].isnan().all()  # what no session took is left alone


def test_the_load_time_warm_up_forwards_every_padded_shape_the_pool_has_room_for(model):
    """On a GPU this compiles each shape's kernels and captures its graph at load; here it runs the
    same forwards eagerly, and their ranges all come back."""
    from specd.engine.packed_forward import _compile_steady_shapes

    pool = _pool(model, 5 * BLOCK_TOKENS)  # room for 512: shapes of 16 to 256 queries
    packer = enable_packing(model, pool)
    shapes = []
    packer.over_pool.run_model = lambda ids, *rest, run=packer.over_pool.run_model: shapes.append(ids.shape[1]) or run(ids, *rest)
    _compile_steady_shapes(packer)
    assert shapes == [16, 16, 32, 32, 64, 64, 128, 128, 256]
    assert pool.used_tokens() == 0


def test_a_worker_reports_the_fast_paths_its_forwards_take_now(model):
    """CUDA graphs that turn off while a worker serves (a replay that differs from its eager
    forward) leave its Info and its specd_backend_info metric at once."""
    from specd.core.sampling import SamplingSettings
    from specd.engine.loading import LoadedModel
    from specd.observability.metrics import WorkerMetrics
    from target_service.runner import TargetModelRunner

    loaded = LoadedModel("m", model, None, 384, 2048, (), SamplingSettings(), "", "float32", "cpu")
    runner = TargetModelRunner(loaded, SessionStore(4, 60.0, pool=_pool(model)), fast_paths=("loaded_path",))
    runner._packer.over_pool.graphs = True  # as on a GPU, where they are captured
    metrics = WorkerMetrics("target")
    metrics.report_backend(runner)

    def reported() -> str:
        return next(s.labels["fast_paths"] for f in metrics.registry.collect() for s in f.samples if s.name == "specd_backend_info")

    assert runner.fast_paths == ("loaded_path", "packed_forward", "kv_pool", "pooled_attention", "cuda_graphs")
    assert reported() == ",".join(runner.fast_paths)
    runner._packer.over_pool._turn_off()
    assert runner.fast_paths == ("loaded_path", "packed_forward", "kv_pool", "pooled_attention")
    assert reported() == ",".join(runner.fast_paths)


def test_a_session_the_pool_has_no_room_for_is_refused_before_its_forward(model, monkeypatch):
    """check_admits tells a worker's servicer at once what open would refuse."""
    import time

    from specd.engine import session_cache

    store = SessionStore(4, 60.0, pool=_pool(model, 3 * BLOCK_TOKENS))  # room for 2 blocks
    store.open("held", 0, 2 * BLOCK_TOKENS)
    monkeypatch.setattr(session_cache, "_last_collect", [time.monotonic()])  # a collection just ran: open would not run one first
    with pytest.raises(TooManySessions, match="KV pool"):
        store.check_admits("next", 0, BLOCK_TOKENS)
    store.check_admits("held", 0, 10**6)  # an open session is not admitted again
    store.check_admits("next", 5, BLOCK_TOKENS)  # nor one resumed part-way: open says it is not here
    store.end("held")
    store.check_admits("next", 0, BLOCK_TOKENS)
