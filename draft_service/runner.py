"""The draft model runner: sessions and forwards, with no gRPC in it."""

from __future__ import annotations

import dataclasses

import threading

from draft_service.speculation import SpeculationResult, build, draft_distributions, sample_draft_token
from specd.forward import forward_logits, prefill_session
from specd.lean_llama import lean_or_plain
from specd.models import LoadedModel
from specd.sampling import SamplingSettings, SparseDist
from specd.session_cache import SessionStore


@dataclasses.dataclass(frozen=True)
class Proposal:
    draft_tokens: list[int]
    draft_dists: list[SparseDist]  # the q each draft token was sampled from
    forward_ms: float


class DraftModelRunner:
    def __init__(self, loaded: LoadedModel, sessions: SessionStore, max_support: int):
        self.loaded = loaded
        self.model = lean_or_plain(loaded.model)  # a draft's forwards are mostly per-call overhead
        self.sessions = sessions
        self.max_support = max_support

    def prefill(self, session_id: str, start: int, tokens: list[int]) -> tuple[int, float]:
        """Cache every committed token but the last; returns (cached tokens, forward ms)."""
        return prefill_session(self.model, self.sessions.open(session_id, start), start, tokens)

    def propose(
        self,
        session_id: str,
        start: int,
        tokens: list[int],
        num_tokens: int,
        sampling: SamplingSettings,
        max_support: int,
        saguaro_c: float = 1.0,
        saguaro_fanout: list[int] | None = None,
    ) -> Proposal:
        """Draft `num_tokens` tokens autoregressively after the committed history."""
        saguaro_fanout = saguaro_fanout or []
        session = self.sessions.open(session_id, start)
        committed, feed = session.sync(start, tokens)
        support = max_support or self.max_support
        draft_tokens: list[int] = []
        dists: list[SparseDist] = []
        total_ms = 0.0
        for i in range(num_tokens):
            logits, forward_ms = forward_logits(self.model, session.cache, feed, 1)  # [1, V]
            session.extend(feed)
            total_ms += forward_ms
            saguaro_f = saguaro_fanout[i] if i < len(saguaro_fanout) else 0
            dist = draft_distributions(logits, sampling, support, saguaro_c, saguaro_f)[0]
            token = sample_draft_token(dist, sampling, len(committed) + i)
            draft_tokens.append(token)
            dists.append(dist)
            feed = [token]
        return Proposal(draft_tokens=draft_tokens, draft_dists=dists, forward_ms=total_ms)

    def speculate(
        self,
        session_id: str,
        start: int,
        tokens: list[int],
        draft_tokens: list[int],
        num_tokens: int,
        fanout: list[int],
        sampling: SamplingSettings,
        max_support: int,
        saguaro_c: float,
        saguaro_fanout: list[int],
        cancel: threading.Event,
        on_guesses=None,
    ) -> SpeculationResult:
        """SSD: the speculation cache for the round verifying `draft_tokens` (see speculation.py)."""
        session = self.sessions.open(session_id, start)
        committed, feed = session.sync(start, tokens)
        return build(
            self.model,
            session,
            committed,
            feed,
            draft_tokens,
            num_tokens,
            fanout,
            sampling,
            max_support or self.max_support,
            saguaro_c,
            saguaro_fanout,
            cancel,
            on_guesses,
        )

    def end_session(self, session_id: str) -> bool:
        return self.sessions.end(session_id)

    def expire_idle(self) -> list[str]:
        return self.sessions.expire_idle()
