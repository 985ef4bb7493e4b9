#!/usr/bin/env python
"""Train specd's bundled demo model pair from scratch, offline, on CPU.

The recipe (issue 3):

* corpus: the Python standard library's own source (``sysconfig.get_paths()["stdlib"]``),
  ``*.py`` files only, leaving out test folders, lib2to3, site-packages and
  ``__pycache__``; files joined with ``<|endoftext|>``; train/validation split by a
  stable hash (sha1) of the relative path, about 5% held out (the held-out list is
  written to ``<out>/heldout_files.txt``);
* tokenizer: byte-level BPE (``tokenizers``), vocab 4096, one special token
  ``<|endoftext|>`` used as bos/eos/pad, wrapped in ``PreTrainedTokenizerFast``;
* target: ``LlamaForCausalLM`` trained with next-token cross-entropy;
* draft: a much smaller ``LlamaForCausalLM`` distilled from the target's logits
  (forward KL, KL(p_target || p_draft), on the target's full soft distribution);
* draft, sequence-level: then distilled on the target's own greedy continuations of
  training windows, against the target's top-k distribution kept from generation
  (``--seq-kd-*``; what the draft sees when it drafts is the target's output);
* export: both models in HF format (bf16 weights on disk, same tokenizer files in
  both folders) under ``<out>/target`` and ``<out>/draft``.

Every stage runs a FIXED number of optimizer steps with batches drawn from a generator
seeded by (seed, step), so a rerun with the same command, the same thread count and
the same library versions reproduces the weights bit for bit, and a run killed at any
point resumes from the last checkpoint in ``--work`` and still ends with the same
weights.  Rerunning a finished stage is a no-op (delete ``--work`` to start over).

Usage (the command used for the committed models is in models/demo/README.md):

    python tools/train_demo.py --out models/demo --work .demo-train
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import sys
import sysconfig
import time
from pathlib import Path

EOT = "<|endoftext|>"
EXCLUDED_DIRS = {"test", "tests", "idle_test", "lib2to3", "site-packages", "__pycache__"}


# ----------------------------------------------------------------------------- corpus


def stdlib_files(root: Path) -> list[str]:
    """Relative paths (posix, sorted) of the stdlib's *.py files, tests etc. left out."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in EXCLUDED_DIRS)
        for name in filenames:
            if name.endswith(".py"):
                rel = (Path(dirpath) / name).relative_to(root).as_posix()
                out.append(rel)
    return sorted(out)


def is_heldout(rel: str, percent: int) -> bool:
    h = int.from_bytes(hashlib.sha1(rel.encode("utf-8")).digest()[:8], "big")
    return h % 100 < percent


def build_corpus(work: Path, out: Path, heldout_percent: int) -> dict:
    """Write train.txt / valid.txt (documents joined by EOT) and the held-out list."""
    meta_path = work / "corpus.json"
    if meta_path.exists():
        return json.loads(meta_path.read_text())
    root = Path(sysconfig.get_paths()["stdlib"])
    files = stdlib_files(root)
    train_docs, valid_docs, heldout, skipped = [], [], [], []
    for rel in files:
        try:
            text = (root / rel).read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            skipped.append(rel)
            continue
        if not text.strip():
            continue
        if is_heldout(rel, heldout_percent):
            valid_docs.append(text)
            heldout.append(rel)
        else:
            train_docs.append(text)
    work.mkdir(parents=True, exist_ok=True)
    (work / "train.txt").write_text(EOT.join(train_docs), encoding="utf-8")
    (work / "valid.txt").write_text(EOT.join(valid_docs), encoding="utf-8")
    out.mkdir(parents=True, exist_ok=True)
    (out / "heldout_files.txt").write_text(
        f"# held-out (validation) files, relative to the stdlib of Python "
        f"{sys.version_info.major}.{sys.version_info.minor}\n" + "\n".join(heldout) + "\n"
    )
    meta = {
        "stdlib": str(root),
        "python": sys.version.split()[0],
        "files_train": len(train_docs),
        "files_valid": len(valid_docs),
        "files_skipped": skipped,
        "bytes_train": len(EOT.join(train_docs).encode("utf-8")),
        "bytes_valid": len(EOT.join(valid_docs).encode("utf-8")),
    }
    meta_path.write_text(json.dumps(meta, indent=2))
    return meta


# -------------------------------------------------------------------------- tokenizer


def build_tokenizer(work: Path, vocab_size: int):
    from transformers import PreTrainedTokenizerFast

    tok_dir = work / "tokenizer"
    if not (tok_dir / "tokenizer.json").exists():
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

        text = (work / "train.txt").read_text(encoding="utf-8")
        docs = text.split(EOT)
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            min_frequency=2,
            special_tokens=[EOT],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=True,
        )
        tok.train_from_iterator(docs, trainer=trainer, length=len(docs))
        fast = PreTrainedTokenizerFast(
            tokenizer_object=tok, bos_token=EOT, eos_token=EOT, pad_token=EOT,
            model_max_length=2048,
        )
        fast.save_pretrained(tok_dir)
    return PreTrainedTokenizerFast.from_pretrained(tok_dir)


def encode_corpus(work: Path, tokenizer):
    import torch

    path = work / "tokens.pt"
    if path.exists():
        return torch.load(path)
    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    result = {}
    for split in ("train", "valid"):
        docs = (work / f"{split}.txt").read_text(encoding="utf-8").split(EOT)
        ids: list[int] = []
        for i, enc in enumerate(tokenizer._tokenizer.encode_batch(docs)):
            if i:
                ids.append(eot_id)
            ids.extend(enc.ids)
        result[split] = torch.tensor(ids, dtype=torch.int16 if len(tokenizer) < 32768 else torch.int32)
    torch.save(result, path)
    return result


# ----------------------------------------------------------------------------- models


def llama_config(tokenizer, hidden: int, layers: int, heads: int, intermediate: int, max_pos: int):
    from transformers import LlamaConfig

    eot_id = tokenizer.convert_tokens_to_ids(EOT)
    return LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=True,
        bos_token_id=eot_id,
        eos_token_id=eot_id,
        pad_token_id=eot_id,
    )


def get_batch(data, step: int, seed: int, batch: int, seq: int):
    """Deterministic batch for `step`: random windows of seq+1 tokens."""
    import torch

    g = torch.Generator().manual_seed(seed * 1_000_003 + step)
    starts = torch.randint(0, data.numel() - seq - 1, (batch,), generator=g)
    idx = starts[:, None] + torch.arange(seq + 1)[None, :]
    return data[idx].long()


def lr_at(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * t)))


def evaluate(model, data, seq: int, max_windows: int | None = None, teacher=None, batch: int = 8):
    """Mean next-token loss (nats/token) over non-overlapping windows of the stream.

    With a teacher, also the forward KL and the argmax agreement with the teacher."""
    import torch
    import torch.nn.functional as F

    model.eval()
    n = (data.numel() - 1) // seq
    if max_windows is not None:
        n = min(n, max_windows)
    tot_loss, tot_tok, tot_kl, tot_agree = 0.0, 0, 0.0, 0
    with torch.no_grad():
        for i in range(0, n, batch):
            rows = range(i, min(n, i + batch))
            x = torch.stack([data[r * seq : r * seq + seq + 1] for r in rows]).long()
            logits = model(x[:, :-1]).logits.float()
            tot_loss += F.cross_entropy(logits.flatten(0, 1), x[:, 1:].flatten(), reduction="sum").item()
            tot_tok += x[:, 1:].numel()
            if teacher is not None:
                t_logits = teacher(x[:, :-1]).logits.float()
                t_logp = F.log_softmax(t_logits, -1)
                s_logp = F.log_softmax(logits, -1)
                tot_kl += (t_logp.exp() * (t_logp - s_logp)).sum().item()
                tot_agree += (t_logits.argmax(-1) == logits.argmax(-1)).sum().item()
    model.train()
    res = {"loss": tot_loss / tot_tok, "tokens": tot_tok}
    if teacher is not None:
        res["kl"] = tot_kl / tot_tok
        res["argmax_agreement"] = tot_agree / tot_tok
    return res


def train_stage(name, model, data, valid, args, steps, lr, batch, seq, work: Path, teacher=None,
                batch_fn=None, loss_from: int = 0, seed_offset: int | None = None):
    """Fixed-step AdamW training with checkpoint/resume. Returns the trained model.

    batch_fn(step, seed) -> [batch, seq+1] token ids (default: random windows of `data`), or
    (ids, top_ids, top_logp) to distil against those soft targets instead of the teacher's
    forward (see continuation_batches); only predictions from position `loss_from` on count."""
    import torch
    import torch.nn.functional as F
    from tqdm import tqdm

    sdir = work / name
    sdir.mkdir(parents=True, exist_ok=True)
    final = sdir / "final.pt"
    log = open(sdir / "log.jsonl", "a")
    if final.exists():
        model.load_state_dict(torch.load(final))
        print(f"[{name}] already trained ({final}); skipping", flush=True)
        return model
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0}],
        lr=lr, betas=(0.9, 0.95), eps=1e-8,
    )
    start = 0
    ckpt = sdir / "ckpt.pt"
    if ckpt.exists():
        state = torch.load(ckpt)
        model.load_state_dict(state["model"])
        opt.load_state_dict(state["opt"])
        start = state["step"]
        print(f"[{name}] resuming from step {start}", flush=True)
    seed = args.seed + (seed_offset if seed_offset is not None else (0 if teacher is None else 1))
    if batch_fn is None:
        batch_fn = lambda step_, seed_: get_batch(data, step_, seed_, batch, seq)  # noqa: E731
    model.train()
    bar = tqdm(range(start, steps), initial=start, total=steps, desc=name, file=sys.stdout,
               mininterval=10, dynamic_ncols=False, ncols=110)
    t0, tok0 = time.time(), 0
    for step in bar:
        cur_lr = lr_at(step, steps, lr, args.warmup)
        for gr in opt.param_groups:
            gr["lr"] = cur_lr
        x = batch_fn(step, seed)  # [batch, seq+1], or with the target's top-k as soft targets
        soft = None
        if isinstance(x, tuple):
            x, *soft = x
        logits = model(x[:, :-1]).logits[:, loss_from:]  # [batch, seq-loss_from, V]
        if soft is not None:
            loss = top_k_distillation_loss(logits, *soft)
        elif teacher is None:
            loss = F.cross_entropy(logits.flatten(0, 1).float(), x[:, loss_from + 1 :].flatten())
        else:
            with torch.no_grad():
                t_logp = F.log_softmax(teacher(x[:, :-1]).logits[:, loss_from:].float(), -1)
            s_logp = F.log_softmax(logits.float(), -1)
            loss = (t_logp.exp() * (t_logp - s_logp)).sum(-1).mean()  # forward KL
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        tok0 += x[:, loss_from + 1 :].numel()
        rate = tok0 / max(1e-9, time.time() - t0)
        bar.set_postfix(loss=f"{loss.item():.3f}", lr=f"{cur_lr:.1e}", tok_s=f"{rate:.0f}")
        rec = {"step": step + 1, "loss": round(loss.item(), 5), "lr": cur_lr, "time": time.time()}
        done = step + 1
        if done % args.eval_every == 0 or done == steps:
            ev = evaluate(model, valid, seq, max_windows=args.eval_windows, teacher=teacher)
            rec["val"] = ev
            bar.write(f"[{name}] step {done}/{steps} train {loss.item():.4f} val {json.dumps(ev)}")
        log.write(json.dumps(rec) + "\n")
        log.flush()
        stop = args.stop_after is not None and done >= args.stop_after and done != steps
        if (done % args.ckpt_every == 0 or stop) and done != steps:
            tmp = sdir / "ckpt.pt.tmp"
            torch.save({"model": model.state_dict(), "opt": opt.state_dict(), "step": done}, tmp)
            os.replace(tmp, ckpt)
        if stop:
            bar.close()
            print(f"[{name}] stopped after step {done} (--stop-after); rerun to resume", flush=True)
            sys.exit(3)
    bar.close()
    torch.save(model.state_dict(), final)
    if ckpt.exists():
        ckpt.unlink()
    return model


def target_continuations(target, data, work: Path, args) -> dict:
    """The target's own greedy continuations of training windows, with its top-k distribution.

    Batch i continues `--seq-kd-rows` windows of `--seq-kd-prompt` tokens, drawn by a
    generator seeded by (seed, i), with `--seq-kd-new` greedy tokens (KV cache, no EOS
    stop). At every generated position the target's top `--seq-kd-topk` log-probabilities
    are kept as well: the soft targets come free with generation, so the draft's training
    needs no target forward. Saved after every batch; a killed run resumes at the next.

    Returns ids [R, prompt+new] int16, top_ids [R, new, k] int16, top_logp [R, new, k] float16.
    """
    import torch

    path = work / "target_continuations.pt"
    rows, prompt, new, k = args.seq_kd_rows, args.seq_kd_prompt, args.seq_kd_new, args.seq_kd_topk
    done = torch.load(path) if path.exists() else {
        "ids": torch.empty(0, prompt + new, dtype=torch.int16),
        "top_ids": torch.empty(0, new, k, dtype=torch.int16),
        "top_logp": torch.empty(0, new, k, dtype=torch.float16),
    }
    target.generation_config.eos_token_id = None  # run on past EOT, as training windows do
    for i in range(done["ids"].shape[0] // rows, args.seq_kd_batches):
        g = torch.Generator().manual_seed(args.seed * 1_000_003 + 7_000_000 + i)
        starts = torch.randint(0, data.numel() - prompt - 1, (rows,), generator=g)
        x = data[starts[:, None] + torch.arange(prompt)[None, :]].long()  # [rows, prompt]
        with torch.inference_mode():
            out = target.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=new, do_sample=False,
                                  pad_token_id=target.config.pad_token_id, output_logits=True,
                                  return_dict_in_generate=True)
        logp = torch.stack(out.logits, 1).float().log_softmax(-1)  # [rows, new, V]
        top = logp.topk(k, -1)  # [rows, new, k]
        done = {
            "ids": torch.cat([done["ids"], out.sequences.to(torch.int16)]),
            "top_ids": torch.cat([done["top_ids"], top.indices.to(torch.int16)]),
            "top_logp": torch.cat([done["top_logp"], top.values.to(torch.float16)]),
        }
        torch.save(done, path)
        print(f"[continuations] batch {i + 1}/{args.seq_kd_batches}: {done['ids'].shape[0]} rows", flush=True)
    return {key: value[: args.seq_kd_batches * rows] for key, value in done.items()}


def continuation_batches(continuations: dict, batch: int):
    """batch_fn for train_stage: `batch` continuations drawn by a generator seeded by (seed, step),
    as (ids [batch, L] int64, top_ids [batch, new, k] int64, top_logp [batch, new, k] float32)."""
    import torch

    def draw(step: int, seed: int):
        g = torch.Generator().manual_seed(seed * 1_000_003 + step)
        rows = torch.randint(0, continuations["ids"].shape[0], (batch,), generator=g)
        return (continuations["ids"][rows].long(), continuations["top_ids"][rows].long(),
                continuations["top_logp"][rows].float())

    return draw


def top_k_distillation_loss(logits, top_ids, top_logp):
    """Cross-entropy of the draft against the target's top-k distribution, the rest lumped.

    logits: [B, N, V] draft; top_ids, top_logp: [B, N, k] target. Over the partition {each
    top-k token, everything else} this is KL(p_target || p_draft) up to the target's entropy.
    """
    import torch

    s_logp = torch.log_softmax(logits.float(), -1)  # [B, N, V]
    p_top = top_logp.exp()  # [B, N, k]
    q_top_logp = s_logp.gather(-1, top_ids)  # [B, N, k]
    p_rest = (1.0 - p_top.sum(-1)).clamp_min(0.0)  # [B, N]
    q_rest_logp = torch.log1p(-q_top_logp.exp().sum(-1).clamp(max=1.0 - 1e-6))  # [B, N]
    return (-(p_top * q_top_logp).sum(-1) - p_rest * q_rest_logp).mean()


def round_to_bf16(model):
    """Round weights to bf16 and back: what is stored on disk is what later stages see."""
    import torch

    with torch.no_grad():
        for p in model.parameters():
            p.copy_(p.to(torch.bfloat16).to(p.dtype))
    return model


def export(model, tokenizer, path: Path):
    import torch

    path.mkdir(parents=True, exist_ok=True)
    model.generation_config.do_sample = False
    model.generation_config.bos_token_id = model.config.bos_token_id
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.to(torch.bfloat16).save_pretrained(path, safe_serialization=True)
    model.to(torch.float32)
    tokenizer.save_pretrained(path)


# ------------------------------------------------------------------------------- main


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default="models/demo", help="where target/ and draft/ are written")
    p.add_argument("--work", default=".demo-train", help="corpus, tokens, checkpoints, logs")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--threads", type=int, default=1, help="torch threads (part of what makes a rerun bit-exact)")
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--heldout-percent", type=int, default=5)
    p.add_argument("--seq", type=int, default=256, help="training window (tokens)")
    p.add_argument("--max-pos", type=int, default=2048, help="max_position_embeddings (serving context)")
    p.add_argument("--target-shape", default="320x10", help="HIDDENxLAYERS")
    p.add_argument("--target-steps", type=int, default=200)
    p.add_argument("--target-batch", type=int, default=8)
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--draft-shape", default="192x1", help="HIDDENxLAYERS")
    p.add_argument("--draft-steps", type=int, default=300)
    p.add_argument("--draft-batch", type=int, default=8)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--seq-kd-batches", type=int, default=14, help="batches of target continuations")
    p.add_argument("--seq-kd-rows", type=int, default=96, help="continuations per batch")
    p.add_argument("--seq-kd-prompt", type=int, default=48, help="prompt tokens per continuation")
    p.add_argument("--seq-kd-new", type=int, default=160, help="greedy tokens per continuation")
    p.add_argument("--seq-kd-topk", type=int, default=32, help="target log-probabilities kept per position")
    p.add_argument("--seq-kd-steps", type=int, default=300, help="draft steps on them (0 = skip the stage)")
    p.add_argument("--seq-kd-batch", type=int, default=16)
    p.add_argument("--seq-kd-lr", type=float, default=1e-3)
    p.add_argument("--warmup", type=int, default=30)
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--eval-windows", type=int, default=48, help="validation windows for periodic evals")
    p.add_argument("--ckpt-every", type=int, default=25)
    p.add_argument("--stop-after", type=int, default=None,
                   help="checkpoint and exit once a stage reaches this step (tests resumption)")
    p.add_argument("--stage", default="all", choices=["all", "target", "draft"],
                   help="stop after this stage (all = target, draft, export)")
    args = p.parse_args(argv)

    # on a shared machine, spinning OpenMP workers only steal time from everyone
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    t_start = time.time()
    work, out = Path(args.work), Path(args.out)
    work.mkdir(parents=True, exist_ok=True)
    (work / "args.json").write_text(json.dumps(vars(args), indent=2))

    meta = build_corpus(work, out, args.heldout_percent)
    print(f"corpus: {meta['files_train']} train files ({meta['bytes_train']/1e6:.2f} MB), "
          f"{meta['files_valid']} held out ({meta['bytes_valid']/1e6:.2f} MB)", flush=True)
    tokenizer = build_tokenizer(work, args.vocab)
    tokens = encode_corpus(work, tokenizer)
    train, valid = tokens["train"], tokens["valid"]
    print(f"tokens: train {train.numel():,}  valid {valid.numel():,}  "
          f"bytes/token {meta['bytes_train']/train.numel():.3f}", flush=True)

    from transformers import LlamaForCausalLM

    def shape(s):
        h, l = (int(v) for v in s.lower().split("x"))
        heads = max(1, h // 64)
        inter = ((h * 8 // 3) + 31) // 32 * 32
        return llama_config(tokenizer, h, l, heads, inter, args.max_pos)

    torch.manual_seed(args.seed)
    target = LlamaForCausalLM(shape(args.target_shape)).float()
    n_t = sum(p.numel() for p in target.parameters())
    print(f"target {args.target_shape}: {n_t/1e6:.2f}M parameters; "
          f"{args.target_steps} steps x {args.target_batch}x{args.seq} tokens", flush=True)
    target = train_stage("target", target, train, valid, args, args.target_steps, args.target_lr,
                         args.target_batch, args.seq, work)
    round_to_bf16(target)
    if args.stage == "target":
        return
    target.eval()
    for p_ in target.parameters():
        p_.requires_grad_(False)

    torch.manual_seed(args.seed + 1)
    draft = LlamaForCausalLM(shape(args.draft_shape)).float()
    n_d = sum(p.numel() for p in draft.parameters())
    print(f"draft {args.draft_shape}: {n_d/1e6:.2f}M parameters; distilled "
          f"{args.draft_steps} steps x {args.draft_batch}x{args.seq} tokens", flush=True)
    draft = train_stage("draft", draft, train, valid, args, args.draft_steps, args.draft_lr,
                        args.draft_batch, args.seq, work, teacher=target)
    round_to_bf16(draft)
    if args.seq_kd_steps > 0:
        # Sequence-level distillation: the draft is judged on the target's own continuations
        # (that is what it drafts during generation), so it learns the target's distribution
        # along them, not only along corpus text.
        continuations = target_continuations(target, train, work, args)
        rows, length = continuations["ids"].shape
        print(f"draft: {args.seq_kd_steps} steps x {args.seq_kd_batch} of {rows} target continuations", flush=True)
        draft = train_stage("draft_seq_kd", draft, None, valid, args, args.seq_kd_steps, args.seq_kd_lr,
                            args.seq_kd_batch, length - 1, work, teacher=target,
                            batch_fn=continuation_batches(continuations, args.seq_kd_batch),
                            loss_from=args.seq_kd_prompt - 1, seed_offset=2)
        round_to_bf16(draft)
    if args.stage == "draft":
        return

    # ----- export + final evaluation on the whole held-out stream
    export(target, tokenizer, out / "target")
    export(draft, tokenizer, out / "draft")
    ln2 = math.log(2)
    bpt = meta["bytes_valid"] / valid.numel()
    ev_t = evaluate(target, valid, args.seq)
    ev_d = evaluate(draft, valid, args.seq, teacher=target)
    metrics = {
        "target": {"shape": args.target_shape, "params": n_t, "val_loss_nats_per_token": ev_t["loss"],
                   "val_bits_per_byte": ev_t["loss"] / ln2 / bpt, "val_tokens": ev_t["tokens"]},
        "draft": {"shape": args.draft_shape, "params": n_d, "val_loss_nats_per_token": ev_d["loss"],
                  "val_bits_per_byte": ev_d["loss"] / ln2 / bpt, "val_kl_from_target": ev_d["kl"],
                  "val_argmax_agreement_with_target": ev_d["argmax_agreement"]},
        "valid_bytes_per_token": bpt,
        "corpus": meta,
        "args": vars(args),
        "wall_time_s_this_invocation": time.time() - t_start,
    }
    (work / "metrics.json").write_text(json.dumps(metrics, indent=2))
    print(json.dumps({k: metrics[k] for k in ("target", "draft")}, indent=2), flush=True)


if __name__ == "__main__":
    main()
