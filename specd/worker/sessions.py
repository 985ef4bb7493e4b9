"""A worker's session store, sized for the model it loaded: its count cap and its KV budget."""

from __future__ import annotations

import logging

from specd.engine.kv_budget import KVBudget, budget_bytes, kv_bytes_per_token
from specd.engine.loading import LoadedModel
from specd.engine.session_cache import SessionStore
from specd.worker.config import WorkerConfig

log = logging.getLogger(__name__)


def session_store(config: WorkerConfig, loaded: LoadedModel, shards: int = 1, admits: bool = True) -> SessionStore:
    """The store of --max-sessions sessions within --kv-cache-bytes. `admits`: False for a tensor-parallel
    follower, which opens the sessions rank 0 admitted (its own free memory may differ a little)."""
    per_token = kv_bytes_per_token(loaded.model, shards)
    limit = budget_bytes(config.kv_cache_bytes, loaded.model.device) if admits else 0
    budget = KVBudget(bytes_per_token=per_token, budget_bytes=limit, max_tokens=loaded.context_length)
    if limit:
        log.info(
            "KV cache budget %.0f MiB at %d bytes a token: %d tokens", limit / (1 << 20), per_token, limit // max(per_token, 1)
        )
    return SessionStore(config.max_sessions, config.session_idle_timeout_s, budget)
