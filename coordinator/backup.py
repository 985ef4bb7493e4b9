"""ssd's backup: the draft of a round whose cache lookup missed.

A prompt-lookup guess over the committed history (`ngram`, no model call) or a just-in-time
Propose on the draft worker (`jit`), as the request's policy says (coordinator/policy.py).
"""

from __future__ import annotations

import dataclasses

from coordinator.config import CoordinatorConfig
from coordinator.draft_link import DraftLink
from coordinator.draft_wait import answer_within
from coordinator.request_state import RequestState
from coordinator.speculation_cache import Draft
from coordinator.ssd_speculator import saguaro
from specd.core.context_match import one_hot, prompt_lookup
from specd.wire.convert import sparse_list_from_proto


@dataclasses.dataclass(frozen=True)
class BackupDraft(Draft):
    source: str = ""  # ngram or jit: what drafted it


async def draft_after_miss(state: RequestState, draft: DraftLink, config: CoordinatorConfig, backup: str, num_draft: int) -> BackupDraft:
    """A miss's draft of `num_draft` tokens by `backup`; raises DraftFailed when a Propose fails or hangs.

    A lookup that finds no match would leave the round no draft at all, one token for a whole
    verification: the draft proposes instead (source `jit`).
    """
    if backup == "ngram":
        guess = prompt_lookup(state.committed, num_draft)
        if guess:
            return BackupDraft(guess, one_hot(guess), "ngram")
    num_draft = min(num_draft, draft.room(len(state.committed)))
    if num_draft <= 0:  # the draft's context is full: the round verifies no draft
        return BackupDraft([], [], "jit")
    params = saguaro(config, state, state.policy.fanout(num_draft, draft.info.vocab_size)[:num_draft])
    proposal = draft.propose(state.draft_session, state.committed, num_draft, state.sampling, state.max_support, params)
    response = await answer_within(draft, proposal, state.draft_wait_s())
    return BackupDraft(list(response.draft_tokens), sparse_list_from_proto(response.draft_probs), "jit")
