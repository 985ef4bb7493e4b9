"""How the target's next token is chosen while it writes the recipe's data: greedily, or
sampled with a temperature and top-p."""

from __future__ import annotations

import torch


def choose_next(logits: torch.Tensor, temperature: float, top_p: float, generator: torch.Generator, candidates: int | None = None) -> torch.Tensor:
    """Greedy at temperature 0, else temperature + top-p sampling. logits [B, V] -> [B].

    With `candidates`, each row's nucleus is looked for among its `candidates` likeliest tokens
    first: on a CPU a top-k of 1024 costs about a tenth of sorting 49152 ids (48 rows, one
    thread, timed with timeit). A row whose candidates do not hold more than
    top_p of the mass is sorted whole, so every row keeps the tokens a whole sort keeps.
    """
    if temperature == 0.0:
        return logits.argmax(-1)
    probs = torch.softmax(logits / temperature, dim=-1)  # [B, V]
    if top_p >= 1.0:
        return torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    if candidates is None or candidates >= probs.shape[-1]:
        return _draw_from_nucleus(*probs.sort(dim=-1, descending=True), top_p, generator)
    top_probs, top_ids = probs.topk(candidates, dim=-1)  # [B, M] each, descending
    whole = top_probs.cumsum(-1)[:, -1] <= top_p  # [B]: the nucleus may reach past the candidates
    token = torch.empty(probs.shape[0], dtype=torch.long, device=probs.device)  # [B]
    if not bool(whole.all()):
        token[~whole] = _draw_from_nucleus(top_probs[~whole], top_ids[~whole], top_p, generator)
    if bool(whole.any()):
        token[whole] = _draw_from_nucleus(*probs[whole].sort(dim=-1, descending=True), top_p, generator)
    return token


def nucleus(sorted_probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """The top-p weights of probabilities sorted descending [B, M]: each row keeps its likeliest
    tokens up to the first whose mass before it exceeds top_p; the rest become 0. [B, M]"""
    outside = sorted_probs.cumsum(-1) - sorted_probs > top_p  # [B, M]: mass before it already > top_p
    return sorted_probs.masked_fill(outside, 0.0)


def _draw_from_nucleus(sorted_probs: torch.Tensor, sorted_ids: torch.Tensor, top_p: float, generator: torch.Generator) -> torch.Tensor:
    """One token per row from the nucleus of sorted_probs [B, M], whose ids are sorted_ids [B, M]. -> [B]"""
    picked = torch.multinomial(nucleus(sorted_probs, top_p), 1, generator=generator)  # [B, 1]
    return sorted_ids.gather(-1, picked).squeeze(-1)
