"""The draft model runner: sessions and forwards, with no gRPC in it.

Propose and Speculate are step jobs (specd/engine/step_batcher.py): generators that yield each
forward they need, so that the jobs of different sessions share forwards (run_alone runs one
by itself).
"""

from __future__ import annotations

import dataclasses
import threading

import torch

from draft_service.copy_drafting import OFF, CopyDrafting
from draft_service.speculation import DraftPenalty, build_steps, distributions_from, draft_reads, sample_draft_token
from specd.core.sampling import SamplingSettings, SparseDist
from specd.engine.forward import forward_logits, prefill_session
from specd.engine.lean_llama import lean_or_plain
from specd.engine.loading import LoadedModel
from specd.engine.packed_forward import Segment, enable_packing, graphs_fit, packing_fast_paths
from specd.engine.session_cache import Session, SessionStore
from specd.engine.step_batcher import Job, Reads, Step, guarded_step


@dataclasses.dataclass(frozen=True)
class Proposal:
    draft_tokens: list[int]
    draft_dists: list[SparseDist]  # the q each draft token was sampled from
    forward_ms: float


class DraftModelRunner:
    def __init__(
        self, loaded: LoadedModel, sessions: SessionStore, max_support: int, copy: CopyDrafting = OFF, backend: str = "cpu",
        fast_paths: tuple[str, ...] = (), lean: bool = True, cuda_graphs: bool = False,
    ):
        self.loaded = loaded
        self.copy = copy
        # A small draft's forwards are mostly per-call overhead on a CPU: its backend says lean.
        self.model = lean_or_plain(loaded.model) if lean else loaded.model
        self.packer = enable_packing(loaded.model, sessions.pool, graphs_fit(cuda_graphs, loaded.model))  # None: one session per forward
        self.sessions = sessions
        self.max_support = max_support
        self.backend = backend  # the device backend the model runs on, and the fast paths it took at load
        self._loaded_fast_paths = fast_paths + (("lean_forward",) if self.model is not loaded.model else ())

    @property
    def fast_paths(self) -> tuple[str, ...]:
        """The fast paths the model's forwards take now (CUDA graphs may have turned off since load)."""
        return self._loaded_fast_paths + packing_fast_paths(self.packer, self.sessions.pool)

    def prefill(self, session_id: str, start: int, tokens: list[int], reserve_tokens: int = 0) -> tuple[int, float]:
        """Cache every committed token but the last; returns (cached tokens, forward ms).
        reserve_tokens, here and below: the KV room a session the call opens reserves."""
        return prefill_session(self.model, self.sessions.open(session_id, start, reserve_tokens), start, tokens)

    def propose_job(
        self,
        session_id: str,
        start: int,
        tokens: list[int],
        num_tokens: int,
        sampling: SamplingSettings,
        max_support: int,
        saguaro_c: float = 1.0,
        saguaro_fanout: list[int] | None = None,
        reserve_tokens: int = 0,
    ) -> Job:
        """Propose as a step job: one forward per draft token."""
        saguaro_fanout = saguaro_fanout or []
        session = self.sessions.open(session_id, start, reserve_tokens)
        committed, feed = session.sync(start, tokens)
        support = max_support or self.max_support
        copier = self.copy.over(committed)
        penalty = DraftPenalty(sampling, committed)
        draft_tokens: list[int] = []
        dists: list[SparseDist] = []
        total_ms = 0.0
        for i in range(num_tokens):
            saguaro_f = saguaro_fanout[i] if i < len(saguaro_fanout) else 0

            def read(logits: torch.Tensor, drafted: list[int] = list(draft_tokens), saguaro_f: int = saguaro_f):
                return draft_reads(penalty.apply(logits, [drafted]), sampling, support, saguaro_c, saguaro_f)  # of [1, V]

            _, forward_ms, q = yield from self.step(session, feed, read)
            session.extend(feed)
            total_ms += forward_ms
            dist = copier.mix(distributions_from(q, sampling)[0], draft_tokens, sampling.greedy)
            token = sample_draft_token(dist, sampling, len(committed) + i)
            draft_tokens.append(token)
            dists.append(dist)
            feed = [token]
        return Proposal(draft_tokens=draft_tokens, draft_dists=dists, forward_ms=total_ms)

    def step(self, session: Session, feed: list[int], read: Reads):
        """One forward of `feed` after the session's cache, as a job's step; its StepOutput."""
        return (yield from guarded_step(session, Step(
            Segment(session.cache, feed, 1), lambda: forward_logits(self.model, session.cache, feed, 1), read,
        )))

    def speculate_job(
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
        reserve_tokens: int = 0,
    ) -> Job:
        """Speculate as a step job: step 0, then one forward per tree step."""
        session = self.sessions.open(session_id, start, reserve_tokens)
        committed, feed = session.sync(start, tokens)
        return (yield from build_steps(
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
            self.copy,
        ))

    def end_session(self, session_id: str) -> bool:
        return self.sessions.end(session_id)

    def expire_idle(self) -> list[str]:
        return self.sessions.expire_idle()

