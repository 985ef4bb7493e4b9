"""Zero-cost backup drafts for SSD cache misses: prompt lookup over the committed history."""

from __future__ import annotations

from specd.sampling import SparseDist


def prompt_lookup(history: list[int], num_tokens: int, max_ngram: int = 3) -> list[int]:
    """The tokens that followed the latest earlier occurrence of the history's longest suffix.

    Tries suffixes of max_ngram tokens down to one; [] when none recurs. The continuation is
    copied token by token and may run on into the tokens it has just copied, so a stretch that
    repeats with period p (the latest match p tokens back) is guessed to go on repeating for all
    `num_tokens`, instead of the p tokens left before the history ends. Costs no model call, so
    a miss loses only the round's acceptance, never a draft forward on the critical path.
    """
    if num_tokens <= 0:
        return []
    for n in range(min(max_ngram, len(history) - 1), 0, -1):
        suffix = history[-n:]
        for start in range(len(history) - n - 1, -1, -1):
            if history[start : start + n] == suffix:
                return _copy_forward(history, start + n, num_tokens)
    return []


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
