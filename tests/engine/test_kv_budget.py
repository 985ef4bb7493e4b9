"""specd/engine/kv_budget.py and the reservations of specd/engine/session_cache.py: a session is
opened with room for its request's most tokens, allocated once; a worker admits sessions while
their reservations fit its KV budget in bytes and refuses the rest with TooManySessions."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from transformers import DynamicCache

from specd.core.config import ConfigError
from specd.core.errors import TooManySessions
from specd.core.sampling import SamplingSettings
from specd.engine.forward import forward_logits
from specd.engine.kv_budget import KVBudget, budget_bytes, kv_bytes_per_token
from specd.engine.kv_cache import GrowingKVCache
from specd.engine.loading import LoadedModel
from specd.engine.session_cache import SessionStore
from specd.observability.metrics import WorkerMetrics
from specd.worker.config import WorkerConfig
from specd.worker.sessions import session_store
from tests.tiny_models import build_llama

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return build_llama(VOCAB, seed=5, hidden=32, layers=2)


def _key_buffers(cache: GrowingKVCache) -> list[int]:
    return [layer.key_buffer.data_ptr() for layer in cache.layers]


def test_one_token_takes_keys_and_values_of_every_layer(model):
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    expected = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * 4  # float32
    assert kv_bytes_per_token(model) == expected
    assert kv_bytes_per_token(model.to(torch.bfloat16)) == expected // 2
    model.to(torch.float32)
    # Tensor parallel: each rank holds its share of the key/value heads.
    assert kv_bytes_per_token(model, shards=config.num_key_value_heads) == expected // config.num_key_value_heads


def test_a_reserved_cache_is_allocated_once_and_grows_past_its_reservation(model):
    torch.manual_seed(0)
    tokens = torch.randint(0, VOCAB, (40,)).tolist()
    chunks = [(0, 10)] + [(i, i + 2) for i in range(10, 24, 2)] + [(24, 40)]
    reserved, plain = GrowingKVCache(reserve_tokens=24), DynamicCache()
    first = None
    for begin, end in chunks:
        got, _ = forward_logits(model, reserved, tokens[begin:end], 1)
        want, _ = forward_logits(model, plain, tokens[begin:end], 1)
        assert torch.equal(got, want)  # the same numbers as transformers' own cache
        if end <= 24:
            assert reserved.capacity_tokens() == 24
            first = first or _key_buffers(reserved)
            assert _key_buffers(reserved) == first  # filled up to its reservation without a copy
    assert reserved.capacity_tokens() >= 40 and _key_buffers(reserved) != first


def test_sessions_are_admitted_while_their_reservations_fit_the_budget(model):
    per_token = kv_bytes_per_token(model)
    store = SessionStore(8, 60.0, KVBudget(bytes_per_token=per_token, budget_bytes=300 * per_token, max_tokens=1000))
    store.open("a", 0, reserve_tokens=200)
    assert store.held_bytes() == 200 * per_token
    with pytest.raises(TooManySessions, match=r"KV cache budget .* a session of 200 tokens needs"):
        store.open("b", 0, reserve_tokens=200)
    store.open("c", 0, reserve_tokens=100)  # what is left fits
    assert store.held_bytes() == 300 * per_token
    store.end("a")
    store.open("b", 0, reserve_tokens=200)
    assert sorted(s for s in ("a", "b", "c") if s in store) == ["b", "c"]


def test_a_reservation_is_clamped_to_the_context_and_growth_past_it_is_counted(model):
    per_token = kv_bytes_per_token(model)
    store = SessionStore(8, 60.0, KVBudget(bytes_per_token=per_token, budget_bytes=10_000 * per_token, max_tokens=32))
    session = store.open("a", 0, reserve_tokens=1 << 30)  # a caller cannot reserve past the model's context
    assert session.reserve_tokens == 32
    session.sync(0, list(range(40)))
    forward_logits(model, session.cache, list(range(40)), 1)
    session.extend(list(range(40)))
    assert store.held_bytes() == session.cache.capacity_tokens() * per_token > 32 * per_token


def test_without_a_budget_only_the_count_caps_sessions(model):
    store = SessionStore(2, 60.0)
    store.open("a", 0, reserve_tokens=1 << 20)
    store.open("b", 0, reserve_tokens=1 << 20)
    with pytest.raises(TooManySessions, match="maximum of 2 sessions"):
        store.open("c", 0)


def test_the_default_budget_limits_a_gpu_only():
    assert budget_bytes(-1, "cpu") == 0
    assert budget_bytes(-1, "meta") == 0
    assert budget_bytes(0, "cpu") == 0
    assert budget_bytes(12345, "cpu") == 12345


def test_the_worker_metrics_follow_the_store(model):
    per_token = kv_bytes_per_token(model)
    store = SessionStore(8, 60.0, KVBudget(bytes_per_token=per_token, budget_bytes=1000 * per_token))
    metrics = WorkerMetrics("target")
    metrics.track_sessions(store)
    store.open("a", 0, reserve_tokens=64)
    value = metrics.registry.get_sample_value
    assert value("specd_active_sessions") == 1
    assert value("specd_kv_cache_bytes") == 64 * per_token
    assert value("specd_kv_cache_budget_bytes") == 1000 * per_token


def test_a_worker_refuses_to_start_on_a_budget_that_holds_almost_nothing(model):
    loaded = LoadedModel("m", model, None, VOCAB, 2048, (), SamplingSettings(), "", "float32", "cpu")
    config = WorkerConfig(model="m", kv_cache_bytes=10 * kv_bytes_per_token(model))
    with pytest.raises(ConfigError, match="holds 10 tokens"):
        session_store(config, loaded)
    store, served = session_store(dataclasses.replace(config, kv_cache_bytes=300 * kv_bytes_per_token(model)), loaded)
    assert served.context_length == 300 and store.kv_budget.max_tokens == 300
