"""The generate stage: the target continues the recipe's prompts in fixed shards, each a file
under --work/shards that is written once and never redone; and the rows of those shards, read
back for the later stages."""

from __future__ import annotations

import random
import time
from pathlib import Path

import torch

import draft_data
from draft_target import load_target


def stdlib_folder(args) -> Path | None:
    return Path(args.stdlib) if args.stdlib else None


def shard_plan(args, shard: int) -> dict:
    """What shard `shard` generates: its prompt seed and its sampling (greedy or sampled)."""
    rng = random.Random(f"{args.seed}/{shard}")
    temperature = 0.0 if rng.random() < args.greedy_fraction else rng.choice((0.7, 1.0))
    return {"seed": rng.randrange(2**31), "temperature": temperature, "top_p": 0.95 if temperature else 1.0}


def stage_generate(args) -> None:
    shards_dir = args.work / "shards"
    shards_dir.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(args.shards) if i % args.workers == args.worker and not (shards_dir / f"{i:05d}.pt").exists()]
    if not todo:
        return
    if args.device != "cpu":
        # The target's own fp32 distribution is what the draft learns: no TF32 in its matmuls.
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    model, tokenizer = load_target(args.threads, args.device)
    sources = draft_data.read_split(args.heldout_percent, heldout=False, root=stdlib_folder(args))
    definitions = draft_data.all_definitions(sources)
    eos = {int(tokenizer.convert_tokens_to_ids("<|im_end|>")), int(tokenizer.eos_token_id)}
    rows_per_batch = args.rows_per_batch if args.rows_per_batch is not None else (48 if args.device == "cpu" else 512)
    for shard in todo:
        plan = shard_plan(args, shard)
        # Each phase's wall time, so a slow shard says where its time went (the rows come back to
        # the CPU at the end of each continuation, so device work is inside its phase).
        phases = {"started": time.time()}
        prompts = draft_data.make_prompts(tokenizer, sources, definitions, args.shard_size, plan["seed"], args.chat_fraction, args.max_prompt_tokens, args.self_fraction)
        phases["prompts"] = time.time()
        draft_data.write_self_chats(model, tokenizer, prompts, definitions, plan["seed"] + 1, rows_per_batch=rows_per_batch)
        phases["self"] = time.time()
        ids = [tokenizer(p["text"])["input_ids"] for p in prompts]
        rows = draft_data.continue_in_batches(model, ids, rows_per_batch, args.new_tokens, plan["temperature"], plan["top_p"], args.topk, eos, tokenizer.pad_token_id, plan["seed"])
        phases["continue"] = time.time()
        for row, prompt in zip(rows, prompts):
            row["kind"] = prompt["kind"]
        partial = shards_dir / f"{shard:05d}.pt.partial"
        torch.save({"plan": plan, "rows": rows}, partial)
        partial.replace(shards_dir / f"{shard:05d}.pt")
        phases["save"] = time.time()
        generated = sum(len(r["generated_ids"]) for r in rows)
        prompt_tokens = sum(len(r["prompt_ids"]) for r in rows)
        stamps = list(phases.values())
        spent = ", ".join(f"{name} {end - start:.1f}" for name, start, end in zip(list(phases)[1:], stamps, stamps[1:]))
        print(f"shard {shard}: {generated} generated + {prompt_tokens} prompt tokens, T={plan['temperature']}, "
              f"{stamps[-1] - stamps[0]:.0f} s ({spent} s)", flush=True)


def load_rows(work: Path) -> list[dict]:
    paths = sorted((work / "shards").glob("*.pt"))
    if not paths:
        raise SystemExit(f"no shards in {work / 'shards'}: run the generate stage with this --work first")
    rows = []
    for path in paths:
        rows.extend(torch.load(path)["rows"])
    return rows
