"""ssd's backup: the draft of a round whose cache lookup missed.

A prompt-lookup guess over the committed history (`ngram`, no model call) or a just-in-time
Propose on the draft worker (`jit`), as config.ssd_backup says.
"""

from __future__ import annotations

import dataclasses

from coordinator.config import CoordinatorConfig
from coordinator.draft_wait import answer_within
from coordinator.rounds import Generation
from coordinator.speculation_cache import Draft
from coordinator.ssd_sizing import RequestSizing
from coordinator.ssd_speculator import saguaro
from coordinator.draft_link import DraftLink
from specd.context_match import ContextMatcher
from specd.sampling import SparseDist


@dataclasses.dataclass(frozen=True)
class BackupDraft(Draft):
    source: str = ""  # ngram or jit: what drafted it


async def draft_after_miss(gen: Generation, draft: DraftLink, config: CoordinatorConfig, sizing: RequestSizing, num_draft: int) -> BackupDraft:
    """A miss's draft of `num_draft` tokens; raises DraftFailed when a Propose fails or hangs.

    A lookup that finds no match would leave the round no draft at all, one token for a whole
    verification: the draft proposes instead (source `jit`).
    """
    if config.ssd_backup == "ngram":
        guess = prompt_lookup(gen.committed, num_draft)
        if guess:
            return BackupDraft(guess, one_hot(guess), "ngram")
    num_draft = min(num_draft, draft.room(len(gen.committed)))
    if num_draft <= 0:  # the draft's context is full: the round verifies no draft
        return BackupDraft([], [], "jit")
    vocab = draft.info.vocab_size
    params = saguaro(config, gen, sizing.fanout(num_draft, vocab, config.ssd_fanout_r)[:num_draft])
    proposal = draft.propose(gen.draft_session, gen.committed, num_draft, gen.sampling, gen.max_support, params)
    response = await answer_within(draft, proposal, gen.draft_wait_s())
    dists = [SparseDist(list(d.token_ids), list(d.probs)) for d in response.draft_probs]
    return BackupDraft(list(response.draft_tokens), dists, "jit")


def prompt_lookup(history: list[int], num_tokens: int, max_ngram: int = 3) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the history's longest suffix.

    The suffix is max_ngram tokens at most, one at least; [] when not even the last token
    recurs. The continuation is copied token by token and may run on into the tokens it has
    just copied, so a stretch that repeats with period p (the latest match p tokens back) is
    guessed to go on repeating for all `num_tokens`, instead of the p tokens left before the
    history ends. Costs no model call, so a miss loses only the round's acceptance, never a
    draft forward on the critical path.
    """
    if num_tokens <= 0:
        return []
    source = ContextMatcher(history, 1, longest=max_ngram).match_end()
    return _copy_forward(history, source, num_tokens) if source is not None else []


def _copy_forward(history: list[int], source: int, num_tokens: int) -> list[int]:
    """num_tokens tokens copied from history[source:], reading on into the copy itself."""
    copied: list[int] = []
    for position in range(source, source + num_tokens):
        # Past the history's end, position reads what this copy put there (source < len(history)).
        copied.append(history[position] if position < len(history) else copied[position - len(history)])
    return copied


def one_hot(tokens: list[int]) -> list[SparseDist]:
    """The q of a deterministic guess: one-hot on each token. A valid q at any temperature:
    the ratio test accepts x with probability p(x) and otherwise samples from p without x."""
    return [SparseDist(token_ids=[t], probs=[1.0]) for t in tokens]
