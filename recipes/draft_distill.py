"""Distillation: fixed-step AdamW training of the draft's own weights on the target's top-k
log-probabilities (forward KL), batches drawn from a generator seeded by (seed, step), and
checkpointed so that a run resumes where it stopped."""

from __future__ import annotations

import math
import time
from pathlib import Path

import torch

from draft_target import target_vocab_size


def trainable_parameters(draft) -> list[torch.nn.Parameter]:
    borrowed = set(draft.borrowed_state_keys())
    params = []
    for name, param in draft.named_parameters():
        param.requires_grad_(name not in borrowed)
        if param.requires_grad:
            params.append(param)
    return params


def make_batch(rows: list[dict], indices: list[int], seq: int, vocab_index: torch.Tensor):
    """Rows -> (input ids [B, L], label ids [B, L, k] in draft-vocab indices (-1 outside), label log-probs [B, L, k], mask [B, L])."""
    batch = len(indices)
    pieces = []
    for i in indices:
        row = rows[i]
        ids = torch.tensor(row["prompt_ids"] + row["generated_ids"])[: seq + 1]  # [n+g]
        labels = row["top_ids"][: len(ids) - 1].long()  # [len-1, k]: row j predicts ids[j+1]
        values = row["top_logprobs"][: len(ids) - 1].float()
        pieces.append((ids[:-1], labels, values))
    width = max(len(p[0]) for p in pieces)
    k = pieces[0][1].shape[-1]
    input_ids = torch.zeros(batch, width, dtype=torch.long)
    label_ids = torch.full((batch, width, k), -1, dtype=torch.long)
    label_logp = torch.full((batch, width, k), float("-inf"))
    mask = torch.zeros(batch, width)
    for b, (ids, labels, values) in enumerate(pieces):
        n = len(ids)
        input_ids[b, :n] = ids
        label_ids[b, :n] = vocab_index[labels]
        label_logp[b, :n] = values
        mask[b, :n] = 1.0
    return input_ids, label_ids, label_logp, mask


def top_k_kl(draft_logits: torch.Tensor, label_ids: torch.Tensor, label_logp: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Forward KL(p_target || q_draft) over the partition {top-k ids in the draft vocabulary} + {the rest}.

    draft_logits [B, L, N]; label_ids [B, L, k] (draft-vocab indices, -1 = outside it); label_logp [B, L, k].
    """
    draft_logq = torch.log_softmax(draft_logits, dim=-1)  # [B, L, N]
    inside = label_ids >= 0  # [B, L, k]
    target_p = label_logp.exp() * inside  # [B, L, k]
    logq = draft_logq.gather(-1, label_ids.clamp(min=0))  # [B, L, k]
    kl_top = (target_p * (label_logp.masked_fill(~inside, 0.0) - logq)).sum(-1)  # [B, L]
    rest_p = (1.0 - target_p.sum(-1)).clamp(min=1e-8)  # [B, L]
    rest_q = (1.0 - (logq.exp() * inside).sum(-1)).clamp(min=1e-8)  # [B, L]
    kl = kl_top + rest_p * (rest_p.log() - rest_q.log())  # [B, L]
    return (kl * mask).sum() / mask.sum()


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress)))


def distill(args, draft, rows: list[dict], vocab: torch.Tensor, checkpoint: Path, steps: int, peak_lr: float, batch_seed: int, stop_after: int = 0):
    """Fixed-step AdamW distillation, checkpointed at `checkpoint` and resumed from it.

    `steps` sets the learning-rate schedule; with `stop_after` the run ends after that step of it.
    """
    if len(rows) < args.batch:
        raise SystemExit(f"{len(rows)} rows in --work's shards, fewer than one batch (--batch {args.batch}): generate more, or lower --batch")
    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True  # the draft's own training: TF32 is plenty
    draft.to(device)
    params = trainable_parameters(draft)
    optimizer = torch.optim.AdamW(params, lr=peak_lr, betas=(0.9, 0.95), weight_decay=0.0)
    start = 0
    if checkpoint.exists():
        saved = torch.load(checkpoint, map_location=device)
        draft.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        start = saved["step"]
    vocab_index = torch.full((target_vocab_size(),), -1, dtype=torch.long)
    vocab_index[vocab] = torch.arange(len(vocab))
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]["prompt_ids"]) + len(rows[i]["generated_ids"]))
    draft.train()
    started, recent = time.time(), []
    end = min(steps, stop_after) if stop_after else steps
    for step in range(start, end):
        generator = torch.Generator().manual_seed(batch_seed * 1_000_003 + step)
        # Rows of similar length share a batch (little padding): a random window of the length order.
        first = int(torch.randint(0, len(order) - args.batch + 1, (1,), generator=generator))
        indices = order[first : first + args.batch]
        input_ids, label_ids, label_logp, mask = (t.to(device) for t in make_batch(rows, indices, args.seq, vocab_index))
        for group in optimizer.param_groups:
            group["lr"] = lr_at(step, steps, peak_lr, args.warmup)
        hidden = draft.model(input_ids=input_ids, attention_mask=mask.long()).last_hidden_state  # [B, L, H]
        logits = hidden @ draft.lm_head.weight.T  # [B, L, N]
        loss = top_k_kl(logits, label_ids, label_logp, mask)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        recent.append(loss.item())
        if (step + 1) % args.log_every == 0:
            print(f"{checkpoint.stem} step {step + 1}/{steps} loss {sum(recent) / len(recent):.4f} ({time.time() - started:.1f} s)", flush=True)
            recent = []
        if (step + 1) % args.save_every == 0 or step + 1 == end:
            torch.save({"model": draft.state_dict(), "optimizer": optimizer.state_dict(), "step": step + 1}, checkpoint.with_suffix(".partial"))
            checkpoint.with_suffix(".partial").replace(checkpoint)
    draft.eval()
    return draft.cpu()
