"""specd/engine/kv_cache.py: the in-place growing cache computes what transformers' DynamicCache does."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from specd.engine.forward import forward_logits
from specd.engine.kv_cache import GrowingKVCache, GrowingLayer, croppable
from tests.tiny_models import build_llama

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return build_llama(VOCAB, seed=5, hidden=32, layers=2)


def test_forwards_and_rollbacks_give_dynamic_cache_logits_bitwise(model):
    """Rounds as a worker runs them (feed K+1, drop the rejected), across buffer growth."""
    generator = torch.Generator().manual_seed(0)
    growing, dynamic = GrowingKVCache(), DynamicCache()
    prompt = torch.randint(1, VOCAB, (40,), generator=generator).tolist()
    for cache in (growing, dynamic):
        forward_logits(model, cache, prompt, 1)
    length = len(prompt)
    for round_index in range(120):  # ~360 tokens kept: past the first 256-token buffer
        block = torch.randint(1, VOCAB, (5,), generator=generator).tolist()
        got, _ = forward_logits(model, growing, block, 5)  # [5, V]
        want, _ = forward_logits(model, dynamic, block, 5)
        assert torch.equal(got, want), f"round {round_index}"
        drop = round_index % 4  # 0..3 of the 5 rolled back
        growing.crop(-drop)
        dynamic.crop(-drop)
        length += 5 - drop
        assert growing.get_seq_length() == dynamic.get_seq_length() == length
    assert all(isinstance(layer, GrowingLayer) for layer in growing.layers)
    assert growing.layers[0].key_buffer.shape[-2] > 256  # it did grow


def test_crop_to_nothing_and_refill(model):
    cache = GrowingKVCache()
    forward_logits(model, cache, [1, 2, 3, 4], 1)
    cache.crop(-4)
    assert cache.get_seq_length() == 0
    got, _ = forward_logits(model, cache, [7, 8, 9], 1)
    want, _ = forward_logits(model, DynamicCache(), [7, 8, 9], 1)
    assert torch.equal(got, want)


def test_croppable_only_for_full_attention_layers():
    from transformers.cache_utils import DynamicSlidingWindowLayer

    cache = GrowingKVCache()
    cache.layers = [GrowingLayer(), GrowingLayer()]
    assert croppable(cache)
    cache.layers.append(DynamicSlidingWindowLayer(sliding_window=4))
    assert not croppable(cache)


def test_selecting_batch_rows_keeps_those_rows_caches_bitwise(model):
    """Rows that ended leave a batched generation (recipes/draft_data.py); the rest go on as before."""
    generator = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, VOCAB, (4, 12), generator=generator)  # [4, 12]
    growing, dynamic = GrowingKVCache(), DynamicCache()
    keep = torch.tensor([0, 2, 3])
    with torch.inference_mode():
        for cache in (growing, dynamic):
            model(input_ids=prompts, past_key_values=cache, use_cache=True)
            cache.batch_select_indices(keep)
        for step in range(3):
            block = torch.randint(1, VOCAB, (3, 1), generator=generator)  # [3, 1]
            got = model(input_ids=block, past_key_values=growing, use_cache=True).logits  # [3, 1, V]
            want = model(input_ids=block, past_key_values=dynamic, use_cache=True).logits
            assert torch.equal(got, want), f"step {step}"
    assert growing.get_seq_length() == 15 and growing.layers[0].keys.shape[0] == 3
