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
import json
import math
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import draft_data  # noqa: E402


def load_target(threads: int, device: str = "cpu"):
    """(model, tokenizer) of the default target, as the target worker loads it (fp32), on `device`."""
    from specd.engine.default_pair import DEFAULT_TARGET
    from specd.engine.loading import load_causal_lm

    torch.set_num_threads(threads)
    loaded = load_causal_lm(DEFAULT_TARGET)
    return loaded.model.to(device), loaded.tokenizer


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


# ------------------------------------------------------------------------------ vocab


def load_rows(work: Path) -> list[dict]:
    paths = sorted((work / "shards").glob("*.pt"))
    if not paths:
        raise SystemExit(f"no shards in {work / 'shards'}: run the generate stage with this --work first")
    rows = []
    for path in paths:
        rows.extend(torch.load(path)["rows"])
    return rows


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


def target_vocab_size() -> int:
    from specd.engine.default_target import target_folder

    return json.loads((target_folder() / "config.json").read_text())["vocab_size"]


# ------------------------------------------------------------------------------ train


def build_draft(args, vocab: torch.Tensor, trained_layers: int, init_layers: list[int]):
    """A draft before training: borrowed embedding and layers, trained layers and head from the target."""
    from specd.engine.default_target import NAME, target_folder
    from specd.engine.draft_model import DraftLlamaConfig, DraftLlamaForCausalLM, borrow_from_target

    target_config = json.loads((target_folder() / "config.json").read_text())
    for key in ("architectures", "model_type", "transformers_version", "_model_name_or_path", "tie_word_embeddings", "dtype"):
        target_config.pop(key, None)
    target_config["num_hidden_layers"] = args.borrowed_layers + trained_layers
    config = DraftLlamaConfig(draft_vocab_size=len(vocab), borrowed_layers=args.borrowed_layers, borrows_from=NAME, **target_config)
    torch.manual_seed(args.seed)
    draft = DraftLlamaForCausalLM(config).float()
    borrow_from_target(draft, str(target_folder()))
    init_from_target(draft, vocab, init_layers)
    draft.lm_head.token_ids.copy_(vocab)
    return draft


def layer_list(text: str) -> list[int]:
    return [int(i) for i in text.split(",")] if text else []


def init_from_target(draft, vocab: torch.Tensor, init_layers: list[int]) -> None:
    """Trained layers start as copies of the target's layers `init_layers`; norm and head as the target's."""
    from safetensors.torch import load_file

    from specd.engine.default_target import target_folder

    target = load_file(str(target_folder() / "model.safetensors"))
    state = draft.state_dict()
    with torch.no_grad():
        for offset, source in enumerate(init_layers):
            index = draft.config.borrowed_layers + offset
            for key, tensor in target.items():
                if key.startswith(f"model.layers.{source}."):
                    state[key.replace(f"layers.{source}.", f"layers.{index}.", 1)].copy_(tensor)
        state["model.norm.weight"].copy_(target["model.norm.weight"])
        state["lm_head.weight"].copy_(target["model.embed_tokens.weight"][vocab])  # tied in the target


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


# ------------------------------------------------------------------------------ export


def stage_export(args, draft) -> None:
    """The committed folder: config, the draft's own weights in bf16, the target's tokenizer files."""
    import shutil

    from specd.engine.default_target import target_folder
    from specd.engine.draft_model import save_draft

    save_draft(draft, str(args.out))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(target_folder() / name, args.out / name)
    size = sum(p.stat().st_size for p in args.out.iterdir()) / 1e6
    print(f"exported the draft to {args.out} ({size:.1f} MB with its README and prompts)", flush=True)


# ---------------------------------------------------------------------------- evaluate


def greedy_tokens_per_round(runner, prompt_ids: list[int], target_tokens: list[int], k: int) -> tuple[int, int]:
    """Greedy speculative decoding replayed against the target's own greedy continuation:
    (tokens, rounds). Each round is the draft worker's own Propose (its session, KV rollback and
    forward) after the committed tokens; it keeps the matching prefix plus the target's next
    token, as a greedy verify would."""
    from specd.core.sampling import SamplingSettings

    position, rounds = 0, 0
    while position < len(target_tokens):
        committed = prompt_ids + target_tokens[:position]
        drafted = runner.propose("evaluate", 0, committed, min(k, len(target_tokens) - position), SamplingSettings(), 1).draft_tokens
        accepted = 0
        while accepted < len(drafted) and drafted[accepted] == target_tokens[position + accepted]:
            accepted += 1
        position += accepted + 1
        rounds += 1
    runner.end_session("evaluate")
    return len(target_tokens), rounds


def step_ms(model, context: int, repeats: int) -> float:
    """Median one-token forward time (ms) at `context` tokens of KV cache."""
    from transformers import DynamicCache

    cache = DynamicCache()
    with torch.no_grad():
        model(input_ids=torch.randint(0, 8000, (1, context)), past_key_values=cache, use_cache=True)
        times = []
        for _ in range(repeats):
            started = time.perf_counter()
            model(input_ids=torch.tensor([[42]]), past_key_values=cache, use_cache=True)
            times.append((time.perf_counter() - started) * 1000)
            cache.crop(-1)  # transformers 5: a negative count of tokens to drop
    return sorted(times)[len(times) // 2]


def replay_heldout(loaded_draft, heldout: dict[str, list[tuple[list[int], list[int]]]], copy, k: int, label: str) -> dict:
    """Tokens per round of greedy SD at K over the held-out (prompt, target continuation) pairs of each kind."""
    from draft_service.runner import DraftModelRunner
    from specd.engine.session_cache import SessionStore

    runner = DraftModelRunner(loaded_draft, SessionStore(max_sessions=1, idle_timeout_s=3600.0), max_support=1, copy=copy)
    report = {"kinds": {}}
    for kind, pairs in heldout.items():
        per_prompt = [greedy_tokens_per_round(runner, prompt, continuation, k) for prompt, continuation in pairs]
        tokens, rounds = sum(t for t, _ in per_prompt), sum(r for _, r in per_prompt)
        report["kinds"][kind] = {"prompts": len(pairs), "tokens": tokens, "rounds": rounds, "tokens_per_round": tokens / rounds,
                                 "per_prompt": [round(t / r, 3) for t, r in per_prompt]}
        print(f"{label}, {kind}: {tokens / rounds:.3f} tokens per round at K = {k} over {len(pairs)} prompts", flush=True)
    kinds = report["kinds"].values()
    report["tokens_per_round"] = sum(v["tokens"] for v in kinds) / sum(v["rounds"] for v in kinds)
    coded = [report["kinds"][kind] for kind in ("code", "chat") if kind in report["kinds"]]
    report["code_and_chat_tokens_per_round"] = sum(v["tokens"] for v in coded) / sum(v["rounds"] for v in coded)
    print(f"{label}: {report['code_and_chat_tokens_per_round']:.3f} tokens per round on code and chat, {report['tokens_per_round']:.3f} on all", flush=True)
    return report


def vocab_coverage(draft_model, heldout: dict[str, list[tuple[list[int], list[int]]]]) -> dict[str, float]:
    """Per kind, the fraction of the target's continuation tokens that the draft's output layer
    covers (a draft can never draft the others; copy drafting can). 1.0 for a full-vocabulary draft."""
    token_ids = getattr(draft_model.lm_head, "token_ids", None)  # [N], a reduced-vocabulary draft's
    if token_ids is None:
        return {kind: 1.0 for kind in heldout}
    coverage = {}
    for kind, pairs in heldout.items():
        emitted = torch.tensor([t for _, continuation in pairs for t in continuation], dtype=torch.long)  # [T]
        coverage[kind] = torch.isin(emitted, token_ids.cpu()).float().mean().item() if emitted.numel() else 1.0
    return coverage


def heldout_continuations(args, target, tokenizer, eos: set[int]) -> dict[str, list[tuple[list[int], list[int]]]]:
    """The recipe's held-out prompts of each kind and the target's greedy continuation of each."""
    sources = draft_data.read_split(args.heldout_percent, heldout=True, root=stdlib_folder(args))
    definitions = draft_data.all_definitions(sources)
    heldout = {}
    # Prompt kinds by (chat, self) fractions; the held-out self-written requests come from a seed no shard uses.
    for kind, chat_fraction, self_fraction in (("code", 0.0, 0.0), ("chat", 1.0, 0.0), ("self", 0.0, 1.0)):
        prompts = draft_data.make_prompts(tokenizer, sources, definitions, args.eval_prompts, args.seed + 7, chat_fraction, args.max_prompt_tokens, self_fraction)
        draft_data.write_self_chats(target, tokenizer, prompts, definitions, args.seed + 8)
        ids = [tokenizer(p["text"])["input_ids"] for p in prompts]
        rows = draft_data.continue_batch(target, ids, args.eval_new_tokens, 0.0, 1.0, 1, eos, tokenizer.pad_token_id, 0)
        heldout[kind] = [(p, r["generated_ids"]) for p, r in zip(ids, rows)]
    return heldout


def file_continuations(path: Path, target, tokenizer, new_tokens: int, eos: set[int]) -> dict[str, list[tuple[list[int], list[int]]]]:
    """The prompts of a JSON list (draft_data.prompts_file_ids) and the target's greedy
    continuation of each (to its end of turn, `new_tokens` at most), by kind."""
    by_kind: dict[str, list[list[int]]] = {}
    for kind, ids in draft_data.prompts_file_ids(path, tokenizer):
        by_kind.setdefault(kind, []).append(ids)
    continued = {}
    for kind, ids in by_kind.items():
        rows = draft_data.continue_batch(target, ids, new_tokens, 0.0, 1.0, 1, eos, tokenizer.pad_token_id, 0)
        continued[kind] = [(p, r["generated_ids"]) for p, r in zip(ids, rows)]
    return continued


def stage_evaluate(args) -> dict:
    from draft_service.config import DraftConfig
    from draft_service.copy_drafting import OFF
    from specd.engine.default_target import NAME
    from specd.engine.loading import load_causal_lm

    target, tokenizer = load_target(1)
    loaded_draft = load_causal_lm(str(args.out))
    eos = {int(tokenizer.convert_tokens_to_ids("<|im_end|>")), int(tokenizer.eos_token_id)}
    if args.prompts_file:
        heldout = file_continuations(args.prompts_file, target, tokenizer, args.eval_new_tokens, eos)
    else:
        heldout = heldout_continuations(args, target, tokenizer, eos)
    # As the draft worker serves it (copy drafting at its defaults), and the draft model alone.
    served = DraftConfig().copy_drafting()
    report = {"target": NAME, "k": args.eval_k, "copy_ngram": served.ngram, "copy_max_ngram": served.max_ngram, "copy_weight": served.weight,
              "prompts": str(args.prompts_file) if args.prompts_file else "held-out"}
    report.update(replay_heldout(loaded_draft, heldout, served, args.eval_k, "served"))
    report["draft_alone"] = replay_heldout(loaded_draft, heldout, OFF, args.eval_k, "draft alone")
    report["vocab_coverage"] = vocab_coverage(loaded_draft.model, heldout)
    for kind, covered in report["vocab_coverage"].items():
        print(f"draft vocabulary, {kind}: covers {covered:.4f} of the target's continuation tokens", flush=True)
    torch.set_num_threads(1)
    draft_ms, target_ms = step_ms(loaded_draft.model, 256, args.eval_repeats), step_ms(target, 256, args.eval_repeats)
    report.update(draft_step_ms=draft_ms, target_step_ms=target_ms, c=draft_ms / target_ms)
    print(f"served, all: {report['tokens_per_round']:.3f} tokens per round; draft step {draft_ms:.2f} ms, target step {target_ms:.2f} ms, c = {draft_ms / target_ms:.3f}", flush=True)
    args.work.mkdir(parents=True, exist_ok=True)  # evaluate may be the only stage run in this folder
    (args.work / "evaluation.json").write_text(json.dumps(report, indent=2))
    return report


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=("generate", "vocab", "train", "export", "evaluate", "all"))
    parser.add_argument("--work", type=Path, default=Path(".draft-train"))
    parser.add_argument("--out", type=Path, default=Path("models/smollm2-draft"))
    parser.add_argument("--seed", type=int, default=1234)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (generate: per process; train: 2 here)")
    parser.add_argument("--heldout-percent", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where generate and train run (cpu, cuda); evaluate runs on the CPU")
    parser.add_argument("--stdlib", default="", help="the stdlib folder prompts are written from (default: this interpreter's)")
    # generate
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
    # vocab and train
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
    # evaluate
    parser.add_argument("--eval-prompts", type=int, default=16, help="held-out prompts of each kind")
    parser.add_argument("--eval-new-tokens", type=int, default=128)
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="evaluate: a JSON list of prompts to evaluate on instead of the held-out ones (a string: "
                             "a completion prompt; a list of {role, content} messages: a chat)")
    parser.add_argument("--eval-k", type=int, default=4)
    parser.add_argument("--eval-repeats", type=int, default=60)
    args = parser.parse_args(argv)
    if args.tune_from and args.stage == "vocab":
        parser.error("--tune-from takes the draft's own vocabulary: no vocab stage")
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


if __name__ == "__main__":
    main()
