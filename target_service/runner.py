"""The target model runner: sessions and forwards, with no gRPC in it.

The servicer calls these methods from one executor thread. A tensor-parallel
runner offers the same methods: rank 0 broadcasts each call and every rank runs it.
"""

from __future__ import annotations

import dataclasses

import torch

from specd.forward import forward_logits, prefill_session
from specd.models import LoadedModel
from specd.sampling import Purpose, SamplingSettings, SparseDist, keyed_uniforms, logits_to_probs, sparse_to_dense
from specd.session_cache import SessionStore
from specd.verify import greedy_verify, rejection_sample


@dataclasses.dataclass(frozen=True)
class VerifyOutcome:
    accepted: int  # k
    next_token: int  # t*
    is_bonus: bool
    logprobs: list[float]  # of d_1..d_k, t* under the target's raw distribution, when asked
    forward_ms: float
    cached_tokens: int


class TargetModelRunner:
    def __init__(self, loaded: LoadedModel, sessions: SessionStore):
        self.loaded = loaded
        self.sessions = sessions

    def prefill(self, session_id: str, start: int, tokens: list[int]) -> tuple[int, float]:
        """Cache every committed token but the last; returns (cached tokens, forward ms)."""
        return prefill_session(self.loaded.model, self.sessions.open(session_id, start), start, tokens)

    def verify(
        self,
        session_id: str,
        start: int,
        tokens: list[int],
        draft_tokens: list[int],
        draft_dists: list[SparseDist],
        sampling: SamplingSettings,
        return_logprobs: bool,
    ) -> VerifyOutcome:
        """One forward over [last committed token, d_1..d_K], then the ratio test."""
        session = self.sessions.open(session_id, start)
        committed, feed = session.sync(start, tokens)
        num_draft = len(draft_tokens)
        logits, forward_ms = forward_logits(
            self.loaded.model, session.cache, feed + draft_tokens, num_draft + 1
        )  # [K+1, V]
        session.extend(feed + draft_tokens)

        first_position = len(committed)  # absolute position of d_1
        draft = torch.tensor([draft_tokens], dtype=torch.long)  # [1, K]
        if sampling.greedy:
            result = greedy_verify(logits.argmax(-1).unsqueeze(0), draft)
        else:
            target_probs = logits_to_probs(logits, sampling).unsqueeze(0)  # [1, K+1, V]
            draft_probs = sparse_to_dense(draft_dists, logits.shape[-1]).unsqueeze(0)  # [1, K, V]
            accept_u = keyed_uniforms(sampling.seed, first_position, num_draft, Purpose.ACCEPT)  # [K]
            sample_u = keyed_uniforms(sampling.seed, first_position, num_draft + 1, Purpose.SAMPLE)  # [K+1]
            result = rejection_sample(
                target_probs, draft_probs, draft, accept_u.unsqueeze(0), sample_u.unsqueeze(0)
            )
        accepted = int(result.accepted[0])
        next_token = int(result.next_token[0])
        logprobs: list[float] = []
        if return_logprobs:
            emitted = torch.tensor(draft_tokens[:accepted] + [next_token])  # [k+1]
            raw = logits[: accepted + 1].log_softmax(-1)  # [k+1, V]
            logprobs = raw.gather(-1, emitted.unsqueeze(-1)).squeeze(-1).tolist()
        return VerifyOutcome(
            accepted=accepted,
            next_token=next_token,
            is_bonus=bool(result.is_bonus[0]),
            logprobs=logprobs,
            forward_ms=forward_ms,
            cached_tokens=len(session.cached_tokens),
        )

    def end_session(self, session_id: str) -> bool:
        return self.sessions.end(session_id)

    def expire_idle(self) -> list[str]:
        return self.sessions.expire_idle()
