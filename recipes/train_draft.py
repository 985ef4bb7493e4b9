#!/usr/bin/env python
"""specd's recipe for the default draft of SmolLM2-135M-Instruct, offline, on a CPU or a GPU
(--device: generate and train run there; evaluate always runs on the CPU, as the workers do).

Stages, each resumable and skipped once done (the command that made the committed draft is in
models/smollm2-draft/README.md):

  generate  the target continues prompts written from the stdlib's training split, or written
            by the target itself (recipes/draft_data.py), in fixed shards: shard i's prompts and
            sampling come from a generator seeded by (seed, i); a finished shard is a file and
            is never redone, so several processes (--worker J --workers P) can share the shards;
  vocab     the draft's output vocabulary: the N tokens the target emits most in that data;
  train     the draft (specd/engine/draft_model.py: the target's embedding and first layers borrowed,
            frozen; its own layers start as copies of the target's last layers, its head as
            the target's rows for the draft vocabulary) distilled on the target's top-k
            log-probabilities (forward KL), a fixed number of steps with batches drawn from a
            generator seeded by (seed, step), checkpointed every --save-every steps; then, with
            --grow-steps, made deeper (new layers after the borrowed ones that start out adding
            nothing, see stage_grow) and distilled further, checkpointed the same way; or, with
            --tune-from, an exported draft distilled further on this folder's data, its output
            layer first widened to --draft-vocab ids (stage_tune), or, with --grow-steps too,
            that draft grown and distilled --grow-steps steps instead;
  export    the committed files: config, its own layers + final norm + head + vocabulary
            (bf16), the target's tokenizer files (run after train, and by it);
  evaluate  greedy tokens per round at K on held-out prompts (code, chat, and requests the
            target writes itself from a seed no shard uses), or on the prompts of
            --prompts-file, as the draft worker serves the draft (copy drafting at its
            defaults) and of the draft alone, and the step times of draft and target at one
            thread.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

# Each stage lives in a module of its own; the names the recipe's tests use are imported here too.
from draft_build import build_draft  # noqa: E402, F401
from draft_distill import distill  # noqa: E402, F401
from draft_evaluate import file_continuations, stage_evaluate, vocab_coverage  # noqa: E402, F401
from draft_export import stage_export  # noqa: E402
from draft_generate import load_rows, stage_generate  # noqa: E402
from draft_stages import stage_grow, stage_train, stage_tune, tune_start  # noqa: E402
from draft_vocab import stage_vocab, token_counts, widen_vocab  # noqa: E402, F401


def build_parser() -> argparse.ArgumentParser:
    """The recipe's command line: a stage and every stage's flags (this module's docstring is its --help)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_common_arguments(parser)
    add_generate_arguments(parser)
    add_train_arguments(parser)
    add_evaluate_arguments(parser)
    return parser


def add_common_arguments(parser: argparse.ArgumentParser) -> None:
    """The stage to run, and the arguments that more than one stage reads."""
    parser.add_argument("stage", choices=("generate", "vocab", "train", "export", "evaluate", "all"))
    parser.add_argument("--work", type=Path, default=Path(".draft-train"))
    parser.add_argument("--out", type=Path, default=Path("models/smollm2-draft"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (generate: per process; train: 2 here)")
    parser.add_argument("--heldout-percent", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where generate and train run (cpu, cuda); evaluate runs on the CPU")
    parser.add_argument("--stdlib", default="", help="the stdlib folder prompts are written from (default: this interpreter's)")


def add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    """The generate stage's arguments."""
    parser.add_argument("--shards", type=int, default=7)
    parser.add_argument("--shard-size", type=int, default=1024, help="prompts per shard (one batch; 48 fit a CPU)")
    parser.add_argument("--new-tokens", type=int, default=192)
    parser.add_argument("--max-prompt-tokens", type=int, default=256)
    parser.add_argument("--chat-fraction", type=float, default=0.3)
    parser.add_argument("--self-fraction", type=float, default=0.3, help="prompts whose user message the target writes itself")
    parser.add_argument("--greedy-fraction", type=float, default=0.6)
    parser.add_argument("--topk", type=int, default=32)
    parser.add_argument("--rows-per-batch", type=int, default=None,
                        help="prompts continued together (0: the whole shard; default: 48 on a CPU, whose memory "
                             "a shard's KV cache would not fit, 512 on an accelerator: a process of 512 rows held "
                             "43-64 GB of an 80 GB H100)")
    parser.add_argument("--worker", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1)


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """The vocab and train stages' arguments."""
    parser.add_argument("--draft-vocab", type=int, default=8192)
    parser.add_argument("--borrowed-layers", type=int, default=2)
    parser.add_argument("--trained-layers", type=int, default=3)
    parser.add_argument("--init-layers", default="27,28,29", help="the target layers the trained layers start from")
    parser.add_argument("--steps", type=int, default=1200, help="training steps: the length of the learning-rate schedule")
    parser.add_argument("--stop-after", type=int, default=1100, help="end training after this step of the schedule (0: at its end)")
    parser.add_argument("--batch", type=int, default=48)
    parser.add_argument("--seq", type=int, default=448)
    parser.add_argument("--lr", type=float, default=8e-4)
    parser.add_argument("--warmup", type=int, default=100)
    parser.add_argument("--grow-layers", default="", help="the target layers that new layers, added after the borrowed ones, start from")
    parser.add_argument("--grow-steps", type=int, default=0, help="steps after growing (0: no grow stage)")
    parser.add_argument("--grow-lr", type=float, default=3e-4)
    parser.add_argument("--tune-from", type=Path, default=None,
                        help="train: start from this exported draft instead of the target's layers, and distill it "
                             "further on this folder's data (its vocabulary widened to --draft-vocab; with --grow-steps, "
                             "grown by --grow-layers first)")
    parser.add_argument("--tune-steps", type=int, default=600)
    parser.add_argument("--tune-lr", type=float, default=2e-4)
    parser.add_argument("--log-every", type=int, default=100)
    parser.add_argument("--save-every", type=int, default=100)


def add_evaluate_arguments(parser: argparse.ArgumentParser) -> None:
    """The evaluate stage's arguments."""
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts of each kind")
    parser.add_argument("--eval-new-tokens", type=int, default=128)
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="evaluate: a JSON list of prompts to evaluate on instead of the held-out ones (a string: "
                             "a completion prompt; a list of {role, content} messages: a chat)")
    parser.add_argument("--eval-k", type=int, default=4)
    parser.add_argument("--eval-repeats", type=int, default=60)


def run_stages(args) -> None:
    """Run the stages that `args.stage` names, in the recipe's order."""
    if args.stage in ("generate", "all"):
        stage_generate(args)
    if args.tune_from and args.stage in ("train", "export", "all"):
        rows = load_rows(args.work)
        if args.grow_steps:  # grown from the exported draft and distilled --grow-steps, instead of tuned
            draft, vocab = tune_start(args, rows)
            stage_export(args, stage_grow(args, rows, vocab, draft))
        else:
            stage_export(args, stage_tune(args, rows))
    elif args.stage in ("vocab", "train", "export", "all"):
        rows = load_rows(args.work)
        vocab = stage_vocab(args, rows)
        if args.stage in ("train", "export", "all"):
            draft = stage_train(args, rows, vocab)
            if args.grow_steps:
                draft = stage_grow(args, rows, vocab, draft)
            stage_export(args, draft)
    if args.stage in ("evaluate", "all"):
        stage_evaluate(args)


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.tune_from and args.stage == "vocab":
        parser.error("--tune-from takes the draft's own vocabulary: no vocab stage")
    run_stages(args)


if __name__ == "__main__":
    main()
