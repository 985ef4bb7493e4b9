"""The draft model runner: sessions and forwards, with no gRPC in it."""

from __future__ import annotations

import dataclasses

from specd.forward import forward_logits
from specd.models import LoadedModel
from specd.sampling import Purpose, SamplingSettings, SparseDist, keyed_uniform, logits_to_probs, sample_sparse, truncate_to_top
from specd.session_cache import SessionStore


@dataclasses.dataclass(frozen=True)
class Proposal:
    draft_tokens: list[int]
    draft_dists: list[SparseDist]  # the q each draft token was sampled from
    forward_ms: float


class DraftModelRunner:
    def __init__(self, loaded: LoadedModel, sessions: SessionStore, max_support: int):
        self.loaded = loaded
        self.sessions = sessions
        self.max_support = max_support

    def prefill(self, session_id: str, start: int, tokens: list[int]) -> tuple[int, float]:
        session = self.sessions.open(session_id, start)
        _, feed = session.sync(start, tokens)
        forward_ms = 0.0
        if len(feed) > 1:
            _, forward_ms = forward_logits(self.loaded.model, session.cache, feed[:-1], 1)
            session.extend(feed[:-1])
        return len(session.cached_tokens), forward_ms

    def propose(
        self,
        session_id: str,
        start: int,
        tokens: list[int],
        num_tokens: int,
        sampling: SamplingSettings,
        max_support: int,
    ) -> Proposal:
        """Draft `num_tokens` tokens autoregressively after the committed history."""
        session = self.sessions.open(session_id, start)
        committed, feed = session.sync(start, tokens)
        support = max_support or self.max_support
        draft_tokens: list[int] = []
        dists: list[SparseDist] = []
        total_ms = 0.0
        for i in range(num_tokens):
            logits, forward_ms = forward_logits(self.loaded.model, session.cache, feed, 1)  # [1, V]
            session.extend(feed)
            total_ms += forward_ms
            dist = self._draft_distribution(logits[0], sampling, support)
            position = len(committed) + i
            token = sample_sparse(dist, keyed_uniform(sampling.seed, position, Purpose.DRAFT))
            draft_tokens.append(token)
            dists.append(dist)
            feed = [token]
        return Proposal(draft_tokens=draft_tokens, draft_dists=dists, forward_ms=total_ms)

    @staticmethod
    def _draft_distribution(logits, sampling: SamplingSettings, max_support: int) -> SparseDist:
        """q: the target's own logits processing, then the top-N tokens renormalised."""
        if sampling.greedy:
            return SparseDist(token_ids=[int(logits.argmax())], probs=[1.0])
        return truncate_to_top(logits_to_probs(logits, sampling), max_support)

    def end_session(self, session_id: str) -> bool:
        return self.sessions.end(session_id)

    def expire_idle(self) -> list[str]:
        return self.sessions.expire_idle()
