"""Every tensor the engine makes is made on its model's device (`pytest -m device_placement`).

A GPU is not needed to check that: torch's `meta` device is a second device on any build, a
whole transformers Llama forward runs on it, and an operation that mixes it with a CPU tensor
raises (SDPA given a CPU mask beside meta queries: "Tensor on device cpu is not on the expected
device meta"). Values are not there, so these tests run the forwards and the tensor math up to
where values are read back (a token id, an accept count), and the code that reads them is kept
apart from the forwards. On a machine with a GPU the same paths run for real (tools/gpu_check.sh).
"""

from __future__ import annotations

import os

import pytest
import torch

from draft_service.speculation import DraftPenalty, _Tree, truncated_probs
from draft_service.tree_mask import TreeMasks
from specd.core.logits import keyed_uniforms, logits_to_probs, penalize_repeats, sample_from_probs, sparse_to_dense
from specd.core.sampling import Purpose, SamplingSettings, SparseDist
from specd.core.verify import greedy_verify, rejection_sample
from specd.engine import pool_attention
from specd.engine.forward import forward_logits
from specd.engine.kv_cache import GrowingKVCache
from specd.engine.kv_pool import BLOCK_TOKENS, KVPool, PooledKVCache
from specd.engine.lean_llama import LeanLlama
from specd.engine.packed_forward import Packer, Segment, _mask
from specd.engine.session_cache import Session
from target_service.calls import VerifyCall
from target_service.verify_decision import verify_logits
from tests.tiny_models import build_llama

pytestmark = pytest.mark.device_placement



def _device() -> torch.device:
    """meta here; tools/gpu_check.sh runs the same tests on the GPU (SPECD_PLACEMENT_DEVICE=cuda),
    where tensors report the index of the device they are on (cuda:0)."""
    device = torch.device(os.environ.get("SPECD_PLACEMENT_DEVICE", "meta"))
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


DEVICE = _device()
VOCAB = 96
SAMPLED = SamplingSettings(temperature=0.8, top_k=20, top_p=0.9, seed=7, repetition_penalty=1.3)


@pytest.fixture(scope="module")
def model():
    """A tiny Llama (4 query heads on 2 key/value heads) whose weights live on the meta device."""
    return build_llama(VOCAB, seed=3, hidden=32, layers=2).to(DEVICE).eval()


def _cached(model, tokens: list[int]) -> GrowingKVCache:
    cache = GrowingKVCache()
    forward_logits(model, cache, tokens, 1)
    return cache


def test_a_lone_forward_keeps_its_logits_on_the_device(model):
    cache = GrowingKVCache()
    prompt, _ = forward_logits(model, cache, [1, 2, 3, 4, 5], 1)  # a prompt
    verify, _ = forward_logits(model, cache, [6, 7, 8, 9], 4)  # a verify of K + 1 = 4 on the cache
    assert prompt.device == verify.device == DEVICE and verify.shape == (4, VOCAB)
    assert cache.get_seq_length() == 9
    cache.crop(-3)  # a rejected draft rolled back
    assert cache.get_seq_length() == 6


def test_a_packed_forward_builds_its_masks_on_the_device(model):
    """A prompt, a one-token step and a multi-token verify, each on its own cache, in one forward."""
    packer = Packer(model, "sdpa")
    step_cache, verify_cache = _cached(model, [3, 1, 4]), _cached(model, [1, 5, 9, 2])
    logits, _ = packer.forward([
        Segment(GrowingKVCache(), [2, 7, 1, 8, 2], 1),
        Segment(step_cache, [6], 1),
        Segment(verify_cache, [5, 3, 5], 3),
    ])
    assert [tuple(row.shape) for row in logits] == [(1, VOCAB), (1, VOCAB), (3, VOCAB)]
    assert all(row.device == DEVICE for row in logits)
    assert verify_cache.get_seq_length() == 3 + 1 + 3


def test_a_packed_forward_under_eager_attention_builds_its_additive_masks_there(model):
    packer = Packer(model, "eager")  # each segment through transformers' eager attention, given an additive mask
    cached = _cached(model, [4, 5])
    step = Segment(cached, [6, 7], 2)
    assert _mask(step, cached.get_seq_length(), model.device).device == DEVICE  # meta would accept a CPU mask here
    logits, _ = packer.forward([Segment(GrowingKVCache(), [1, 2, 3], 3), step])
    assert all(row.device == DEVICE for row in logits)


def _placed_flex(query, key, value, block_mask, **kwargs):
    """FlexAttention refuses meta inputs: on meta, what it would be given is checked for its device
    (the mask's own tensors, and those its mask_mod reads) and an output of its shape returned."""
    assert query.device == key.device == value.device == DEVICE
    assert all(t.device == DEVICE for t in block_mask.as_tuple() if isinstance(t, torch.Tensor))
    index = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    assert block_mask.mask_mod(index, index, index, torch.arange(key.shape[2], device=DEVICE)).device == DEVICE
    return torch.empty_like(query)


def test_a_packed_forward_over_the_kv_pool_makes_its_mask_and_writes_on_the_device(model, monkeypatch):
    """Sessions whose caches are ranges of one KV pool: a prompt, a step and a tree-like segment
    with its own visibility, attended over the pool in one call per layer."""
    if DEVICE.type == "meta":
        monkeypatch.setattr(pool_attention, "_eager_flex", _placed_flex)
    pool = KVPool.for_model(model, 4 * BLOCK_TOKENS)
    assert pool.device == DEVICE
    packer = Packer(model, "sdpa", pool)
    packer.pooled = True  # the probe compares values, which meta has not
    step_cache = PooledKVCache(pool.allocate(16))
    packer.forward([Segment(step_cache, [3, 1, 4], 1)])
    visible = torch.ones(2, 5, dtype=torch.bool, device=DEVICE).tril(3)  # [L, cached + L]
    logits, _ = packer.forward([
        Segment(PooledKVCache(pool.allocate(16)), [2, 7, 1, 8, 2], 1),
        Segment(step_cache, [6, 5], 2, visible, [3, 4]),
    ])
    assert [tuple(row.shape) for row in logits] == [(1, VOCAB), (2, VOCAB)]
    assert all(row.device == DEVICE for row in logits) and step_cache.get_seq_length() == 5


def _tree(model, prefix: list[int]) -> tuple[Session, TreeMasks]:
    """A session caching `prefix` and the masks of a two-branch tree over it."""
    session = Session(cache=_cached(model, prefix))
    session.extend(prefix[:-1])
    prefix_visible = torch.tensor([len(prefix) - 2, len(prefix) - 1])  # [B]: where each branch's root sits
    return session, TreeMasks(model.config, prefix_visible, session.cache.get_seq_length(), 2, torch.float32, model.device)


def test_a_tree_segment_packs_with_its_visibility_mask(model):
    session, masks = _tree(model, [5, 4, 3, 2, 1])
    visible = masks.visible_at(1)  # [B, L0 + B]
    assert visible.device == DEVICE
    tree = Segment(session.cache, [7, 8], 2, visible, [4, 5])
    logits, _ = Packer(model, "sdpa").forward([tree, Segment(GrowingKVCache(), [1, 2], 1)])
    assert logits[0].shape == (2, VOCAB) and logits[0].device == DEVICE


def test_the_drafts_tree_steps_run_alone_and_packed_on_the_device(model):
    prefix = [9, 8, 7, 6, 5]
    session = Session(cache=_cached(model, prefix[:-1]))
    session.extend(prefix[:-1])
    forward_logits(model, session.cache, prefix[-1:] + [3, 4], 3)  # step 0: the last token and d_1, d_2
    session.extend(prefix[-1:] + [3, 4])
    tree = _Tree(model, session, len(prefix), [(0, 11), (2, 12)], 2, [3, 4])
    alone, _ = tree._alone(1, tree.n + tree.offsets)  # [B, V]
    assert alone.device == DEVICE and alone.shape == (2, VOCAB)
    tree.crop()
    packed = Segment(session.cache, tree.tokens, 2, tree.masks.visible_at(1), (tree.n + tree.offsets).tolist())
    logits, _ = Packer(model, "sdpa").forward([packed, Segment(GrowingKVCache(), [1], 1)])
    assert logits[0].device == DEVICE


def test_the_lean_draft_forward_runs_on_the_device(model):
    lean = LeanLlama(model)
    cache = GrowingKVCache()
    causal = lean(input_ids=torch.tensor([[1, 2, 3]], device=DEVICE), past_key_values=cache, logits_to_keep=1).logits
    session, masks = _tree(model, [5, 4, 3, 2, 1])
    tree = lean(
        input_ids=torch.tensor([[7, 8]], device=DEVICE),
        past_key_values=session.cache,
        attention_mask=masks.at(1),
        position_ids=torch.tensor([[4, 5]], device=DEVICE),
    ).logits
    assert causal.device == tree.device == DEVICE and tree.shape == (1, 2, VOCAB)


def test_the_targets_verify_decides_on_the_device(model):
    """The verify's forward and its ratio test (sampled, penalised) up to the values read back."""
    cache = GrowingKVCache()
    history = [4, 8, 15, 16, 23]
    forward_logits(model, cache, history[:-1], 1)
    logits, _ = forward_logits(model, cache, history[-1:] + [42, 7], 3)  # [K+1, V]
    dists = [SparseDist([42, 1], [0.75, 0.25]), SparseDist([7], [1.0])]
    sampled = verify_logits(VerifyCall("s", 0, history, [42, 7], dists, SAMPLED, False), logits, history, len(history))
    greedy = verify_logits(VerifyCall("s", 0, history, [42, 7], [], SamplingSettings(), False), logits, history, len(history))
    for result in (sampled, greedy):
        assert result.accepted.device == result.next_token.device == result.is_bonus.device == DEVICE


def test_greedy_verify_and_the_ratio_test_stay_on_the_device():
    target_argmax = torch.zeros(2, 4, dtype=torch.long, device=DEVICE)  # [B, K+1]
    greedy = greedy_verify(target_argmax, torch.zeros(2, 3, dtype=torch.long, device=DEVICE))
    target_probs = torch.rand(2, 4, VOCAB, device=DEVICE)  # [B, K+1, V]
    draft_probs = torch.stack([sparse_to_dense([SparseDist([1, 2], [0.5, 0.5])] * 3, VOCAB, DEVICE)] * 2)  # [B, K, V]
    accept = torch.stack([keyed_uniforms(3, 10, 3, Purpose.ACCEPT, DEVICE)] * 2)  # [B, K]
    sample = torch.stack([keyed_uniforms(3, 10, 4, Purpose.SAMPLE, DEVICE)] * 2)  # [B, K+1]
    drafts = torch.ones(2, 3, dtype=torch.long, device=DEVICE)  # [B, K]
    sampled = rejection_sample(target_probs, draft_probs, drafts, accept, sample)
    assert {greedy.accepted.device, sampled.accepted.device, sampled.next_token.device} == {DEVICE}


def test_logits_processing_and_sampling_stay_on_the_device():
    logits = torch.randn(3, VOCAB, device=DEVICE)  # [R, V]
    penalized = penalize_repeats(logits, [1, 2, 3], [[], [4], [4, 5]], 1.3)
    probs = logits_to_probs(penalized, SAMPLED)  # top-k and top-p
    tokens = sample_from_probs(probs, keyed_uniforms(1, 0, 3, Purpose.SAMPLE, DEVICE))
    assert penalized.device == probs.device == tokens.device == DEVICE


def test_the_drafts_q_is_made_on_the_device_until_it_is_read():
    logits = torch.randn(4, VOCAB, device=DEVICE)  # [R, V]
    logits = DraftPenalty(SAMPLED, [1, 2, 3]).apply(logits, [[], [5], [5, 6], [7]])
    probs, ids = truncated_probs(logits, SAMPLED, max_support=16, saguaro_c=0.5, saguaro_f=2)
    assert probs.device == ids.device == DEVICE and probs.shape == ids.shape == (4, 16)
