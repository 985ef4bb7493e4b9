"""The train stage's three ways to a trained draft: from the target's layers (stage_train),
made deeper and distilled further (stage_grow), or an exported draft distilled further on new
data (stage_tune)."""

from __future__ import annotations

import torch

from draft_build import build_draft, layer_list
from draft_distill import distill
from draft_vocab import token_counts, widen_vocab


def stage_train(args, rows: list[dict], vocab: torch.Tensor):
    """The draft at its first depth, distilled from the target's layers; returns it trained."""
    draft = build_draft(args, vocab, args.trained_layers, layer_list(args.init_layers))
    return distill(args, draft, rows, vocab, args.work / "draft.ckpt", args.steps, args.lr, batch_seed=args.seed, stop_after=args.stop_after)


def stage_grow(args, rows: list[dict], vocab: torch.Tensor, trained):
    """The trained draft made deeper, then distilled further; returns it trained.

    The new layers go right after the borrowed ones and start as the target's layers
    `--grow-layers` with their output projections (o_proj, down_proj) zeroed: each adds nothing
    to the residual stream at first, so the grown draft starts out computing exactly what the
    trained one does, and training builds on it instead of starting over.
    """
    if trained.config.borrowed_layers != args.borrowed_layers:
        raise SystemExit(f"the draft to grow borrows {trained.config.borrowed_layers} layers, not --borrowed-layers {args.borrowed_layers}")
    new_layers = layer_list(args.grow_layers)
    own_layers = trained.config.num_hidden_layers - args.borrowed_layers
    grown = build_draft(args, vocab, own_layers + len(new_layers), new_layers)
    shift = len(new_layers)
    state = grown.state_dict()
    with torch.no_grad():
        for key, tensor in trained.state_dict().items():
            parts = key.split(".")  # model.layers.<index>.<rest>, or not a layer's
            if key.startswith("model.layers.") and int(parts[2]) >= args.borrowed_layers:
                parts[2] = str(int(parts[2]) + shift)
            state[".".join(parts)].copy_(tensor)
        for layer in grown.model.layers[args.borrowed_layers : args.borrowed_layers + shift]:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
    # A different batch seed: the grown draft sees other windows of the data than the first stage's.
    return distill(args, grown, rows, vocab, args.work / "grown.ckpt", args.grow_steps, args.grow_lr, batch_seed=args.seed + 1)


def tune_start(args, rows: list[dict]):
    """The exported draft at --tune-from, its output layer widened to --draft-vocab ids
    (widen_vocab), so the draft can learn the tokens of text unlike what it was first trained on:
    (draft, its vocabulary). The borrowed weights stay the target's."""
    from specd.engine.loading import load_causal_lm

    draft = load_causal_lm(str(args.tune_from)).model.float()
    return draft, widen_vocab(draft, token_counts(rows), args.draft_vocab)


def stage_tune(args, rows: list[dict]):
    """The exported draft at --tune-from, distilled further on this folder's data; returns it tuned."""
    draft, vocab = tune_start(args, rows)
    # Another batch seed than train's and grow's: the tuned draft sees its own windows of the data.
    return distill(args, draft, rows, vocab, args.work / "tuned.ckpt", args.tune_steps, args.tune_lr, batch_seed=args.seed + 2)
