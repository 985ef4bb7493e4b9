"""specd/engine/session_cache.py: a session follows the committed tokens on the KV cache a worker uses."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import DynamicCache

from specd.core.errors import SessionNotFound, SessionStale, TooManySessions
from specd.engine.forward import forward_logits
from specd.engine.kv_cache import GrowingKVCache
from specd.engine.session_cache import Session, SessionStore
from tests.tiny_models import build_llama

VOCAB = 64


@pytest.fixture(scope="module")
def model():
    return build_llama(VOCAB, seed=3, hidden=32, layers=2)


def _feed(model, session: Session, start: int, tokens: list[int], drafts: list[int] = ()) -> torch.Tensor:
    """What a worker does: sync, forward the fed tokens (plus a draft), record them; returns the last logits."""
    _, feed = session.sync(start, tokens)
    logits, _ = forward_logits(model, session.cache, feed + list(drafts), len(drafts) + 1)
    session.extend(feed + list(drafts))
    assert session.cache.get_seq_length() == len(session.cached_tokens)
    return logits


def _fresh_logits(model, tokens: list[int]) -> torch.Tensor:
    logits, _ = forward_logits(model, DynamicCache(), tokens, 1)
    return logits[-1]


def test_sync_keeps_the_common_prefix_and_rolls_back_rejected_tokens(model):
    session = Session(cache=GrowingKVCache())
    prompt = [1, 2, 3, 4, 5]
    committed, feed = session.sync(0, prompt)
    assert committed == prompt and feed == prompt
    forward_logits(model, session.cache, feed, 1)
    session.extend(feed)

    # A round drafts [10, 11, 12] after the prompt: the cache holds them too.
    _, feed = session.sync(5, [])  # nothing new committed: only the last token is re-fed
    assert feed == [5]
    assert session.cached_tokens == [1, 2, 3, 4]
    forward_logits(model, session.cache, feed + [10, 11, 12], 4)
    session.extend(feed + [10, 11, 12])
    assert session.cached_tokens == prompt + [10, 11, 12]
    assert session.cache.get_seq_length() == 8

    # d_1 = 10 accepted, d_2 rejected, t* = 20: 11 and 12 are rolled back, 10 stays cached.
    committed, feed = session.sync(5, [10, 20])
    assert committed == prompt + [10, 20]
    assert feed == [20]
    assert session.cached_tokens == prompt + [10]
    assert session.cache.get_seq_length() == len(session.cached_tokens) == 6

    # The rolled-back cache gives the logits a fresh forward gives.
    logits, _ = forward_logits(model, session.cache, feed, 1)
    session.extend(feed)
    torch.testing.assert_close(logits[-1], _fresh_logits(model, committed), rtol=1e-5, atol=1e-5)


def test_sync_always_feeds_the_last_committed_token(model):
    session = Session(cache=GrowingKVCache())
    _feed(model, session, 0, [1, 2, 3])
    assert session.cached_tokens == [1, 2, 3]
    committed, feed = session.sync(0, [1, 2, 3])  # a resend of what is cached
    assert committed == [1, 2, 3] and feed == [3]
    assert session.cached_tokens == [1, 2]
    assert session.cache.get_seq_length() == 2


def test_full_resend_keeps_what_matches(model):
    session = Session(cache=GrowingKVCache())
    _feed(model, session, 0, [1, 2, 3, 4], drafts=[5, 6])
    committed, feed = session.sync(0, [1, 2, 3, 4, 5, 9, 7])
    assert feed == [9, 7]
    assert session.cached_tokens == [1, 2, 3, 4, 5]
    logits, _ = forward_logits(model, session.cache, feed, 1)
    session.extend(feed)
    torch.testing.assert_close(logits[-1], _fresh_logits(model, committed), rtol=1e-5, atol=1e-5)


def test_diverging_history_rolls_back_to_the_divergence(model):
    session = Session(cache=GrowingKVCache())
    _feed(model, session, 0, [1, 2, 3, 4, 5, 6])
    _, feed = session.sync(2, [9, 9])
    assert feed == [9, 9]
    assert session.cached_tokens == [1, 2]
    assert session.cache.get_seq_length() == 2


def test_start_past_the_cache_is_stale(model):
    session = Session(cache=GrowingKVCache())
    _feed(model, session, 0, [1, 2, 3])
    with pytest.raises(SessionStale, match="resend from position 0"):
        session.sync(4, [7])
    assert session.cached_tokens == [1, 2, 3]  # untouched
    session.sync(3, [7])  # continuing right at the end is fine


def test_nothing_committed_is_an_error():
    with pytest.raises(ValueError):
        Session(cache=GrowingKVCache()).sync(0, [])


def test_store_unknown_session_past_zero_is_not_found():
    store = SessionStore(max_sessions=4, idle_timeout_s=60)
    with pytest.raises(SessionNotFound, match="resend from position 0"):
        store.open("ghost", 3)
    assert len(store) == 0
    session = store.open("ghost", 0)
    assert store.open("ghost", 3) is session  # known now: any start is accepted by the store


def test_store_cap():
    store = SessionStore(max_sessions=2, idle_timeout_s=60)
    store.open("a", 0)
    store.open("b", 0)
    store.open("a", 5)  # an existing session does not count twice
    with pytest.raises(TooManySessions, match="maximum of 2"):
        store.open("c", 0)
    assert store.end("a") is True
    assert store.end("a") is False
    store.open("c", 0)
    assert len(store) == 2


def test_store_idle_expiry():
    store = SessionStore(max_sessions=4, idle_timeout_s=0.2)
    store.open("old", 0)
    store.open("busy", 0)
    time.sleep(0.15)
    store.open("busy", 1)  # use refreshes it
    time.sleep(0.1)
    assert store.expire_idle() == ["old"]
    assert len(store) == 1
    with pytest.raises(SessionNotFound):
        store.open("old", 1)
    time.sleep(0.25)
    assert store.expire_idle() == ["busy"]
    assert len(store) == 0


def test_a_prefill_that_fails_part_way_leaves_nothing_cached(model):
    """Its first layer cached the new tokens, its second raised: the session forgets them all,
    and the next call re-sends from the start."""
    from specd.engine.forward import prefill_session

    session = Session(cache=GrowingKVCache())
    prefill_session(model, session, 0, [1, 2, 3, 4])
    last_layer = model.model.layers[-1]

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    hook = last_layer.register_forward_pre_hook(fail)
    try:
        with pytest.raises(RuntimeError):
            prefill_session(model, session, 0, [1, 2, 3, 4, 5, 6, 7])
    finally:
        hook.remove()
    assert session.cached_tokens == [] and session.cache.get_seq_length() == 0
    cached, _ = prefill_session(model, session, 0, [1, 2, 3, 4, 5, 6, 7])
    assert cached == 6 and session.cache.get_seq_length() == 6
