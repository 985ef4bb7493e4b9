"""The speculation cache's tree build (SSD): predict verification outcomes, draft after each.

While the target verifies d_1..d_K, the draft guesses the outcome (k accepted, t*). At each
position j (after d_j; j = 0 is after the last committed token) the guesses are the draft's
top-F_j tokens other than d_{j+1}, ranked as q' ranks them (copy drafting's token first; a
rejected token has zero residual mass, so it is never t*). Every guess g starts a branch; K'
batched forwards then extend all B branches by one token each.

Cost: one forward over [pending committed..., d_1..d_K] (step 0) and K' forwards of B tokens.
The prefix KV cache is never copied: the B branch tokens of each step are appended to the
session's own KV cache as one flattened tree, and a 4-D attention mask lets branch b see
the prefix up to d_{j_b}, its own earlier tokens and itself, at explicit absolute positions.
Afterwards the tree is cropped off, leaving the cache at committed + d_1..d_K.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Callable

import torch

from draft_service.copy_drafting import OFF, Copier, CopyDrafting
from draft_service.tree_mask import TreeMasks, tree_supported
from specd.core.logits import penalize_seen, seen_ids
from specd.core.saguaro import reshape_sorted
from specd.core.sampling import Purpose, SamplingSettings, SparseDist, keyed_uniform, sample_sparse
from specd.engine.forward import elapsed_ms, forward_logits
from specd.engine.kv_cache import croppable
from specd.engine.packed_forward import Segment
from specd.engine.session_cache import Session
from specd.engine.step_batcher import Job, Step, guarded_step


class SpeculationCancelled(Exception):
    """The caller gave up on this build (verification came back first); the cache is restored."""


@dataclasses.dataclass(frozen=True)
class Branch:
    accepted: int  # k: the outcome this branch assumes
    next_token: int  # t*: its guessed recovered or bonus token
    draft_tokens: list[int]  # the next round's draft after committed + d_1..d_k + t*
    draft_dists: list[SparseDist]  # the q each was sampled from


@dataclasses.dataclass(frozen=True)
class SpeculationResult:
    branches: list[Branch]
    forward_ms: float  # step 0 plus the K' tree steps


class DraftPenalty:
    """The request's repetition penalty on the draft's logits, as the target applies it, for one
    job (a Propose, or a tree): the committed tokens' distinct ids are found once, not at each of
    its steps. Not needed for exactness (any q is), but a draft that ignored the penalty would
    propose the repeats the target now turns down."""

    def __init__(self, sampling: SamplingSettings, committed: list[int]):
        self.penalty = sampling.repetition_penalty
        self.seen = seen_ids(committed) if sampling.penalizes else None  # [S]

    def apply(self, logits: torch.Tensor, row_tokens: list[list[int]]) -> torch.Tensor:
        """logits [R, V], row r after the committed tokens and then row_tokens[r]; unchanged
        when the request has no penalty."""
        if self.seen is None:
            return logits
        return penalize_seen(logits, self.seen, row_tokens, self.penalty)


def draft_reads(
    logits: torch.Tensor, sampling: SamplingSettings, max_support: int, saguaro_c: float, saguaro_f: int
) -> tuple[torch.Tensor, ...]:
    """What makes the q each row's draft token is sampled from, on the logits' device, to read back
    for distributions_from: the logits [R, V] processed like the target's, cut to the top-N tokens
    and renormalised, then Saguaro-reshaped (truncated_probs's (probs [R, N], ids [R, N])); greedy,
    the argmax ids [R] (Saguaro has no effect at temperature 0). One batched computation for all
    branches of a tree step (per-row Python here cost more than the step's forward)."""
    if sampling.greedy:
        return (logits.argmax(-1),)
    return truncated_probs(logits, sampling, max_support, saguaro_c, saguaro_f)


def distributions_from(read: list[torch.Tensor], sampling: SamplingSettings) -> list[SparseDist]:
    """Each row's q from draft_reads's tensors, read back (greedy: the one-hot of each argmax)."""
    if sampling.greedy:
        return [SparseDist(token_ids=[t], probs=[1.0]) for t in read[0].tolist()]
    kept, indices = read  # [R, N] each
    dists = []
    for ids, values in zip(indices.tolist(), kept.tolist()):
        if values[-1] > 0:
            dists.append(SparseDist(token_ids=ids, probs=values))
            continue
        # Zeros are not only a suffix: Saguaro at C = 0 zeroes the top F, top-p the tail.
        support = [(i, v) for i, v in zip(ids, values) if v > 0]
        dists.append(SparseDist(token_ids=[i for i, _ in support], probs=[v for _, v in support]))
    return dists


def truncated_probs(
    logits: torch.Tensor, sampling: SamplingSettings, max_support: int, saguaro_c: float, saguaro_f: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The sampled rows' q' as tensors on the logits' device, nothing read back: (probs [R, N]
    renormalised and Saguaro-reshaped, ids [R, N]), sorted by falling probability."""
    values, indices = _top_probs(logits, sampling, max_support)  # [R, N] each
    return reshape_sorted(values / values.sum(-1, keepdim=True), saguaro_f, saguaro_c), indices


def _top_probs(logits: torch.Tensor, sampling: SamplingSettings, max_support: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The top-N tokens' probabilities after temperature, top-k and top-p, unnormalised.

    logits: [R, V] -> (probs [R, N], ids [R, N]), sorted by falling probability. Only the top N
    survive truncation, so top-p is applied from the top down within them (the mass before a
    token must stay below top_p) instead of sorting the whole vocabulary: the same tokens as
    logits_to_probs up to float ties, several times faster at V = 4096.
    """
    scores = logits.float() / sampling.temperature  # [R, V]
    vocab = scores.shape[-1]
    top_k = sampling.top_k if 0 < sampling.top_k < vocab else vocab
    count = min(max_support, top_k)
    if top_k < vocab:
        pool = torch.topk(scores, top_k).values  # [R, top_k]: the softmax's support
        log_norm = torch.logsumexp(pool, -1, keepdim=True)  # [R, 1]
    else:
        log_norm = torch.logsumexp(scores, -1, keepdim=True)  # [R, 1]
    top = torch.topk(scores, count)  # [R, N]
    probs = (top.values - log_norm).exp()  # [R, N]
    if sampling.top_p < 1.0:
        before = probs.cumsum(-1) - probs  # [R, N]: mass of the more likely tokens
        probs = probs.masked_fill(before >= sampling.top_p, 0.0)
    return probs, top.indices


def sample_draft_token(dist: SparseDist, sampling: SamplingSettings, position: int) -> int:
    """The draft token at absolute `position`: keyed by (seed, position, DRAFT) however it is produced."""
    if sampling.greedy:
        return dist.token_ids[0]
    return sample_sparse(dist, keyed_uniform(sampling.seed, position, Purpose.DRAFT))


def _guesses(logits: torch.Tensor, draft_tokens: list[int], fanout: list[int], copies: list[int | None]) -> list[tuple[int, int]]:
    """(j, g) for every branch: the top-F_j tokens at position j, d_{j+1} left out for j < K.

    logits: [K+1, V]. Ranked as q' ranks them: the copied token at j (copies[j], None for none)
    first, then by the raw draft logits, whose order every q shares (exact ties in either order:
    which branches are built, never what a round emits).
    """
    roots: list[tuple[int, int]] = []
    vocab = logits.shape[-1]
    rows = [j for j, count in enumerate(fanout) if count > 0]
    if not rows:
        return roots
    width = min(max(fanout) + 1, vocab)
    # One top-k and one read-back for the positions from the first to the last with branches (a
    # slice: a list index would copy itself to the device first); on a GPU a read-back waits for it.
    ranked_rows = torch.topk(logits[rows[0] : rows[-1] + 1], width).indices.tolist()  # [rows spanned, width]
    for j in rows:
        count = fanout[j]
        ranked = ranked_rows[j - rows[0]][: min(count + 1, vocab)]
        if copies[j] is not None:
            ranked = [copies[j]] + [t for t in ranked if t != copies[j]]
        excluded = draft_tokens[j] if j < len(draft_tokens) else None
        roots.extend((j, g) for g in [t for t in ranked if t != excluded][:count])
    return roots


def build_steps(
    model,
    session: Session,
    committed: list[int],
    feed: list[int],
    draft_tokens: list[int],
    num_tokens: int,
    fanout: list[int],
    sampling: SamplingSettings,
    max_support: int,
    saguaro_c: float = 1.0,
    saguaro_fanout: list[int] | None = None,
    cancel: threading.Event | None = None,
    on_guesses: Callable[[list[tuple[int, int]]], None] | None = None,
    copy: CopyDrafting = OFF,
) -> Job:
    """Build the speculation cache for the round verifying `draft_tokens` after `committed`.

    `feed` is what Session.sync left to feed (ends with the last committed token). Leaves the
    session caching committed + d_1..d_K. fanout: F_0..F_K (len K+1). `on_guesses` gets the
    branches' (k, t*) right after step 0; `cancel` stops the build between steps. A step job
    (specd/engine/step_batcher.py): it yields each forward and returns the result.
    """
    assert len(fanout) == len(draft_tokens) + 1, (fanout, draft_tokens)
    started = time.perf_counter()
    fed, kept = feed + draft_tokens, len(draft_tokens) + 1
    logits, _, _ = yield from guarded_step(session, Step(
        Segment(session.cache, fed, kept), lambda: forward_logits(model, session.cache, fed, kept)
    ))  # [K+1, V]
    session.extend(fed)
    penalty = DraftPenalty(sampling, committed)
    logits = penalty.apply(logits, [draft_tokens[:j] for j in range(len(draft_tokens) + 1)])  # [K+1, V]
    copier = copy.over(committed)
    roots = _guesses(logits, draft_tokens, fanout, [copier.copy_after(draft_tokens[:j]) for j in range(len(fanout))])
    if on_guesses is not None:
        on_guesses(roots)  # the caller can tell a miss now, K' tree steps before the entries
    if not roots or num_tokens == 0 or not croppable(session.cache) or not tree_supported(model.config):
        # Sliding-window caches cannot drop the tree afterwards, and layers that are neither
        # full nor sliding-window attention get no mask here: no branches for them.
        return SpeculationResult([], (time.perf_counter() - started) * 1000.0)
    tree = _Tree(model, session, len(committed), roots, num_tokens, draft_tokens)
    assert tree.prefix_len == len(committed) + len(draft_tokens)
    draft = _TreeDraft(sampling, max_support, saguaro_c, saguaro_fanout or [], copier, penalty)
    try:
        for step in range(1, num_tokens + 1):
            if cancel is not None and cancel.is_set():
                raise SpeculationCancelled()
            yield from tree.step(step, draft)
    finally:
        tree.crop()
    return SpeculationResult(tree.branches(), (time.perf_counter() - started) * 1000.0)


@dataclasses.dataclass(frozen=True)
class _TreeDraft:
    """How each tree step's tokens are drafted: the request's sampling and Saguaro settings, and copy drafting."""

    sampling: SamplingSettings
    max_support: int
    saguaro_c: float
    saguaro_fanout: list[int]  # per tree step; past its end, no reshaping
    copier: Copier  # copy drafting over the committed tokens
    penalty: DraftPenalty  # over the committed tokens, before each branch's own

    def reads(self, step: int, logits: torch.Tensor, histories: list[list[int]]) -> tuple[torch.Tensor, ...]:
        """What a tree step reads back of its logits [B, V] (draft_reads, after the penalty);
        histories[b]: row b's tokens after the committed ones, the one it feeds included."""
        saguaro_f = self.saguaro_fanout[step - 1] if step - 1 < len(self.saguaro_fanout) else 0
        logits = self.penalty.apply(logits, histories)  # [B, V]
        return draft_reads(logits, self.sampling, self.max_support, self.saguaro_c, saguaro_f)

    def dists(self, read: list[torch.Tensor], histories: list[list[int]]) -> list[SparseDist]:
        """Each row's q' from the step's reads, copy drafting mixed in."""
        dists = distributions_from(read, self.sampling)
        return [self.copier.mix(d, h, self.sampling.greedy) for d, h in zip(dists, histories)]


class _Tree:
    """The B branches grown on top of the session's KV cache, one token each per step."""

    def __init__(self, model, session: Session, n: int, roots: list[tuple[int, int]], num_tokens: int, drafted: list[int]):
        self.model = model
        self.drafted = drafted  # d_1..d_K, the round's draft the branches start beside
        self.session = session
        self.n = n  # absolute position of d_1; guess (j, g) sits at n + j
        self.roots = roots
        self.prefix_len = len(session.cached_tokens)  # n + K
        self.offsets = torch.tensor([j for j, _ in roots], dtype=torch.long)  # [B]
        self.tokens = [g for _, g in roots]  # what the next step feeds, one per branch
        self.branch_tokens: list[list[int]] = [[] for _ in roots]
        self.branch_dists: list[list[SparseDist]] = [[] for _ in roots]
        dtype = next(model.parameters()).dtype
        self.masks = TreeMasks(model.config, n + self.offsets, self.prefix_len, num_tokens, dtype, model.device)

    def step(self, step: int, draft: _TreeDraft):
        """One forward of the B branch tokens (a step job's step); each branch samples its next token."""
        positions = self.n + self.offsets + step - 1  # [B]
        segment = Segment(
            self.session.cache, self.tokens, len(self.tokens), self.masks.visible_at(step), positions.tolist(), self.prefix_len
        )
        histories = [self._history(b) for b in range(len(self.roots))]
        _, _, read = yield from guarded_step(self.session, Step(
            segment, lambda: self._alone(step, positions), lambda logits: draft.reads(step, logits, histories)
        ))  # logits [B, V], read back as each row's q'
        dists = draft.dists(read, histories)
        self.tokens = []
        for b, (j, _) in enumerate(self.roots):
            token = sample_draft_token(dists[b], draft.sampling, self.n + j + step)
            self.branch_tokens[b].append(token)
            self.branch_dists[b].append(dists[b])
            self.tokens.append(token)

    def _history(self, b: int) -> list[int]:
        """Branch b's tokens after the committed ones: d_1..d_j, its guess g, what it has drafted."""
        j, g = self.roots[b]
        return self.drafted[:j] + [g] + self.branch_tokens[b]

    @torch.inference_mode()
    def _alone(self, step: int, positions: torch.Tensor) -> tuple[torch.Tensor, float]:
        """The step's forward by itself, with the model's own masks: ([B, V] float32, ms)."""
        device = self.model.device
        started = time.perf_counter()
        output = self.model(
            input_ids=torch.tensor([self.tokens], dtype=torch.long, device=device),  # [1, B]
            attention_mask=self.masks.at(step),  # [1, 1, B, L0 + step*B] (per layer type)
            position_ids=positions.unsqueeze(0).to(device),  # [1, B]
            past_key_values=self.session.cache,
            use_cache=True,
        )
        return output.logits[0].float(), elapsed_ms(started, device)  # [B, V] on the model's device

    def crop(self) -> None:
        """Drop the tree from the KV cache, keeping committed + d_1..d_K."""
        extra = self.session.cache.get_seq_length() - self.prefix_len
        if extra > 0:
            self.session.cache.crop(-extra)  # transformers 5.x: a negative count to drop

    def branches(self) -> list[Branch]:
        return [
            Branch(accepted=j, next_token=g, draft_tokens=self.branch_tokens[b], draft_dists=self.branch_dists[b])
            for b, (j, g) in enumerate(self.roots)
        ]
