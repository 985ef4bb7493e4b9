"""The draft's output vocabulary: the ids the target emits most in the generated data, chosen
for a new draft (the vocab stage) or added to an exported one's (widen_vocab, for tuning)."""

from __future__ import annotations

import torch

from draft_target import target_vocab_size


def stage_vocab(args, rows: list[dict]) -> torch.Tensor:
    """The draft vocabulary: the N ids the target ranks first most often (every position), by count."""
    path = args.work / "draft_vocab.pt"
    if path.exists():
        return torch.load(path)
    counts = token_counts(rows)  # [V]
    ranked = counts.argsort(descending=True)[: args.draft_vocab]  # [N]
    covered = counts[ranked].sum().item() / counts.sum().item()
    print(f"draft vocabulary: {args.draft_vocab} ids cover {covered:.4f} of the target's top-1 and emitted tokens", flush=True)
    vocab = ranked.sort().values
    torch.save(vocab, path)
    return vocab


def token_counts(rows: list[dict]) -> torch.Tensor:
    """[V] how often the target ranks each id first, or emits it, in the rows."""
    # One bincount over every row's ids: a bincount and a vocabulary-wide add per row took 248 s
    # for 13k rows on a 2-core machine beside another process, and stalled two tuning runs on a GPU
    # machine past their time limit.
    top1 = torch.cat([row["top_ids"][:, 0].long() for row in rows])  # [positions]
    emitted = torch.tensor([token for row in rows for token in row["generated_ids"]], dtype=torch.long)  # [generated]
    return torch.bincount(torch.cat([top1, emitted]), minlength=target_vocab_size())  # [V]


def widen_vocab(draft, counts: torch.Tensor, size: int) -> torch.Tensor:
    """Widen the draft's output layer to `size` ids, in place: the ids it has, then the most
    counted ids (`counts` [V]) it lacks, whose rows start as the target's (its embedding rows: the
    target ties its head to them), as a new draft's rows do. Returns the vocabulary [size], sorted."""
    from specd.engine.draft_model import ReducedVocabHead

    head = draft.lm_head
    have = head.token_ids  # [N]
    if size < len(have):
        raise ValueError(f"--draft-vocab {size} would narrow the draft's vocabulary of {len(have)} ids")
    lacking = counts.clone()  # [V]
    lacking[have] = -1
    added = lacking.argsort(descending=True, stable=True)[: size - len(have)]  # [size - N]
    ids = torch.cat([have, added])  # [size]
    rows = torch.cat([head.weight.detach(), draft.model.embed_tokens.weight.detach()[added]])  # [size, H]
    order = ids.argsort()  # [size]
    widened = ReducedVocabHead(rows.shape[1], size, head.vocab_size)
    with torch.no_grad():
        widened.weight.copy_(rows[order])
        widened.token_ids.copy_(ids[order])
    draft.lm_head = widened
    draft.config.draft_vocab_size = size
    total = counts.sum().item()
    print(f"draft vocabulary: {len(have)} ids cover {counts[have].sum().item() / total:.4f} of this data's top-1 and emitted "
          f"tokens, {size} cover {counts[ids].sum().item() / total:.4f}", flush=True)
    return widened.token_ids.clone()
