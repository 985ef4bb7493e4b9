"""Copy drafting: the draft's q mixed with the continuation of an earlier match in the context.

Where the last `ngram` tokens of the history (committed tokens, then what this call has drafted
after them) occurred earlier, the token that followed them then is copied in (after the
occurrence that matches the most of the history's last tokens, `max_ngram` at most; the latest
of those):

    q'(x) = (1 - weight) * q(x) + weight * [x == copy]

q' is what the draft samples from and reports, so the target's ratio test stays exact whatever
the weight (a token outside the draft's vocabulary may be copied: q' still gives it mass).
Greedy drafts take q''s argmax: the copy whenever weight >= 0.5, else the model's own token.

Why: a small draft predicts the stretches an answer quotes from its prompt, or code repeats,
worse than a lookup does (docs/copy-drafting.md has the design, docs/decisions.md the measurement).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

from specd.core.context_match import ContextMatcher
from specd.core.sampling import SparseDist


@dataclasses.dataclass(frozen=True)
class CopyDrafting:
    ngram: int = 0  # 0: off
    weight: float = 0.0  # the copy's share of q'
    max_ngram: int = 0  # the longest match looked for (below ngram: ngram)

    def __post_init__(self):
        if self.ngram < 0 or self.max_ngram < 0 or not 0.0 <= self.weight <= 1.0:
            raise ValueError(f"copy drafting needs ngram >= 0, max_ngram >= 0 and a weight in [0, 1], got {self.ngram}, {self.max_ngram}, {self.weight}")

    @property
    def enabled(self) -> bool:
        return self.ngram > 0 and self.weight > 0.0

    def over(self, committed: Sequence[int]) -> "Copier":
        """Copy drafting for one call's drafts after `committed`."""
        return Copier(self, ContextMatcher(committed, self.ngram, self.max_ngram) if self.enabled else None)

    def mix(self, dist: SparseDist, copy: int | None, greedy: bool) -> SparseDist:
        """q' from the model's q (`dist`) and the copied token (None: no match, q unchanged)."""
        if copy is None or not self.enabled:
            return dist
        if greedy:
            return dataclasses.replace(dist, token_ids=[copy], probs=[1.0]) if self.weight >= 0.5 else dist
        ids = list(dist.token_ids)
        probs = [(1.0 - self.weight) * p for p in dist.probs]
        if copy in ids:
            probs[ids.index(copy)] += self.weight
        else:
            ids.append(copy)
            probs.append(self.weight)
        return dataclasses.replace(dist, token_ids=ids, probs=probs)


OFF = CopyDrafting()


@dataclasses.dataclass(frozen=True)
class Copier:
    """Copy drafting over one call's committed tokens; `extra` is what follows them in a row's history."""

    settings: CopyDrafting
    matcher: ContextMatcher | None  # None: copy drafting is off

    def copy_after(self, extra: Sequence[int]) -> int | None:
        """The copied token after committed + `extra`, or None."""
        return self.matcher.next_token(extra) if self.matcher is not None else None

    def mix(self, dist: SparseDist, extra: Sequence[int], greedy: bool) -> SparseDist:
        """q' for the row whose history is committed + `extra`."""
        return self.settings.mix(dist, self.copy_after(extra), greedy)  # no copy (off, or no match): q itself
