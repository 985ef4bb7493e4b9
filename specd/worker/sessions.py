"""A worker's session store, sized for the model it loaded: its count cap and its KV budget."""

from __future__ import annotations

import dataclasses
import logging

from specd.core.config import ConfigError
from specd.engine.kv_budget import KVBudget, budget_bytes, kv_bytes_per_token
from specd.engine.kv_pool import BLOCK_TOKENS, KVPool
from specd.engine.loading import LoadedModel
from specd.engine.packed_forward import full_attention_only
from specd.engine.session_cache import SessionStore
from specd.worker.config import WorkerConfig

log = logging.getLogger(__name__)

MIN_CONTEXT_TOKENS = 64  # a budget that holds fewer serves no useful request: refused at start
MIN_POOL_TOKENS = 2 * BLOCK_TOKENS  # a session's block and the spare one


def session_store(config: WorkerConfig, loaded: LoadedModel, shards: int = 1, admits: bool = True) -> tuple[SessionStore, LoadedModel]:
    """The store of --max-sessions sessions within --kv-cache-bytes, and the model as the worker serves
    it: where the budget cannot hold one session of the model's whole context, the context served
    is what it holds (as its Info then says), so that every session fits once others have ended.
    `admits`: False for a tensor-parallel follower, which opens the sessions rank 0 admitted."""
    per_token = kv_bytes_per_token(loaded.model, shards)
    limit = budget_bytes(config.kv_cache_bytes, loaded.model.device, config.gpu_memory_fraction) if admits else 0
    if limit:
        budget_tokens = limit // per_token
        if budget_tokens < MIN_CONTEXT_TOKENS:
            raise ConfigError(
                f"--kv-cache-bytes: a budget of {limit} bytes holds {budget_tokens} tokens at {per_token} bytes a token; "
                f"a worker needs room for at least {MIN_CONTEXT_TOKENS} ({MIN_CONTEXT_TOKENS * per_token} bytes)"
            )
        log.info("KV cache budget %.0f MiB at %d bytes a token: %d tokens", limit / (1 << 20), per_token, budget_tokens)
        if budget_tokens < loaded.context_length:
            log.warning(
                "the KV cache budget holds %d tokens, less than the model's context of %d: serving a context of %d tokens",
                budget_tokens, loaded.context_length, budget_tokens,
            )
            loaded = dataclasses.replace(loaded, context_length=budget_tokens)
    pool = None
    if _pools(config.kv_pool, limit // per_token if limit else 0, shards, loaded.model):
        pool = KVPool.for_model(loaded.model, limit // per_token, shards)
        log.info("KV pool of %d tokens on %s: a batch attends over it in one call per layer", pool.room, pool.device)
        loaded = dataclasses.replace(loaded, context_length=min(loaded.context_length, pool.room))
    budget = KVBudget(bytes_per_token=per_token, budget_bytes=limit, max_tokens=loaded.context_length)
    return SessionStore(config.max_sessions, config.session_idle_timeout_s, budget, pool), loaded


def _pools(setting: str, budget_tokens: int, shards: int, model) -> bool:
    """Whether --kv-pool puts the sessions' caches in one pool (see WorkerConfig.kv_pool) of a
    budget of `budget_tokens` (0: none)."""
    if setting == "off":
        return False
    fits = full_attention_only(model.config.get_text_config())
    if setting == "auto":
        return model.device.type == "cuda" and budget_tokens >= MIN_POOL_TOKENS and shards == 1 and fits
    if shards > 1:
        raise ConfigError("--kv-pool on: not with tensor parallelism (each rank would place sessions on its own)")
    if not budget_tokens:
        raise ConfigError("--kv-pool on: the pool is the KV budget; give one with --kv-cache-bytes (a CPU has none by default)")
    if budget_tokens < MIN_POOL_TOKENS:
        raise ConfigError(f"--kv-pool on: a budget of {budget_tokens} tokens; a pool needs at least {MIN_POOL_TOKENS}")
    if not fits:
        raise ConfigError("--kv-pool on: the model has layers that do not attend to the whole context")
    return True
