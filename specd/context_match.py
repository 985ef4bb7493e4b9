"""The token that followed an earlier occurrence of a history's last n (or more) tokens.

Answers quote their prompts (the code under review, the function to document, a name defined
a few lines up) and code repeats itself; where the history's last few tokens occurred before,
what followed them then is a strong guess at what follows now (draft_service/copy_drafting.py).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


class ContextMatcher:
    """Continuations looked up in one history: `committed`, fixed for a call, plus a few tokens after it.

    An occurrence must match the history's last `ngram` tokens; with `longest` > `ngram`, of the
    occurrences the one matching the most of its last tokens (`longest` at most) wins, the latest
    among equals. A longer match is a surer guess: on the draft recipe's 48 held-out prompts
    (greedy copy drafting, K = 4, `tools/train_draft.py evaluate`, 2026-11-28), copying after the
    longest match of up to 8 tokens gave 2.789 tokens per round against 2.761 after the latest of 3.
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
