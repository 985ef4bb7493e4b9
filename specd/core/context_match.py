"""The token that followed an earlier occurrence of a history's last n (or more) tokens.

Answers quote their prompts (the code under review, the function to document, a name defined
a few lines up) and code repeats itself; where the history's last few tokens occurred before,
what followed them then is a strong guess at what follows now (draft_service/copy_drafting.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from specd.core.sampling import SparseDist


class ContextMatcher:
    """Continuations looked up in one history: `committed`, fixed for a call, plus a few tokens after it.

    An occurrence must match the history's last `ngram` tokens; with `longest` > `ngram`, of the
    occurrences the one matching the most of its last tokens (`longest` at most) wins, the latest
    among equals. A longer match is a surer guess (docs/decisions.md, copy_max_ngram).
    """

    def __init__(self, committed: Sequence[int], ngram: int, longest: int = 0):
        if ngram < 1:
            raise ValueError(f"ngram must be >= 1, got {ngram}")
        self.ngram = ngram
        self.longest = max(ngram, longest)
        self.committed = np.asarray(committed, dtype=np.int64)  # [C]

    def next_token(self, extra: Sequence[int] = ()) -> int | None:
        """The token after the chosen earlier occurrence of the last `ngram` (or more) tokens of
        committed + extra; None when they do not occur earlier."""
        history = self._history(extra)
        end = self._match_end(history)
        return int(history[end]) if end is not None else None

    def match_end(self, extra: Sequence[int] = ()) -> int | None:
        """The position right after that occurrence (where its continuation starts), or None."""
        return self._match_end(self._history(extra))

    def _history(self, extra: Sequence[int]) -> np.ndarray:
        return np.concatenate((self.committed, np.asarray(extra, dtype=np.int64))) if len(extra) else self.committed  # [L]

    def _match_end(self, history: np.ndarray) -> int | None:
        n = self.ngram
        windows = len(history) - n  # windows start at 0..L-n-1: each has a following token
        if windows < 1:
            return None
        suffix = history[windows:]  # [n]
        hits = history[:windows] == suffix[0]  # [L-n]: window j starts with the suffix's first token
        for i in range(1, n):
            hits &= history[i : windows + i] == suffix[i]
        found = np.flatnonzero(hits)  # [F] window starts, ascending
        if not found.size:
            return None
        # Keep the windows whose match also reaches `extended` tokens further back, while any does.
        for extended in range(1, min(self.longest - n, windows) + 1):
            earlier = found - extended  # [F]: the token `extended` before each window
            reaching = found[(earlier >= 0) & (history[np.maximum(earlier, 0)] == history[windows - extended])]
            if not reaching.size:
                break
            found = reaching
        return int(found[-1]) + n


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
